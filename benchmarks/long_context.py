"""Long prompts under context parallelism (issue 15), through the OpenAI API of real
``tierserve serve --cp-size N`` nodes with HiCache and a real ``mooncake_master``:

1. TTFT of prompts of ``--lengths`` tokens (32K and 128K), uncached (a *writer* node computes a
   fresh prompt) and from L3 (a *reader* node of the same CP size, which never saw it, reads it once
   the writer backed it up), CP=1 vs CP=2: all five nodes up at once, the CP sizes in rotating
   order, one warm-up round at the shortest length, medians of ``--repeats`` rounds. TTFT is the
   client's time from sending to the first streamed token. CP=1's nodes use both cores; a second
   CP=1 reader (``cp1_1t``) has one thread, as each CP=2 rank, and reads the same prompt as the first
   (the two CP=1 readers in alternating order): CP=2 / CP=1 from L3 is reported at equal total cores
   and at equal per-rank resources, medians of per-round ratios.
2. The share of each layer's gather left exposed at CP=2 (``engine/cp/gather.py``): over each
   timed request, the change of rank 0's ``tierserve_cp_gather_*_seconds_total`` (time attention
   waited for its layer's gather / time from the gather's start to the end of that wait), layer 0
   (started just before the forward, nothing to hide it) apart from the later layers (target:
   under 10%).
3. The split of the compute (``engine/cp/split.py``; ``--only split``): uncached TTFT of one fresh
   prompt per round and length on five nodes without L3, up at once, in rotating order (the same
   prompt on each, fresh to each, answers checked equal): CP=1 with one thread, CP=1 with two, CP=2
   (one thread per rank: long steps split their tokens), CP=2 with ``--cp-attention gather``
   (every rank computes every token: the seed's protocol) and TP=2 (one thread per rank). Ratios are
   medians of per-round ratios: equal per-rank resources (CP=2 / CP=1 one thread, target <= 0.6;
   TP=2 / CP=1 one thread, i.e. TP=1, target <= 0.7), equal total cores (CP=2 / CP=1 two threads,
   target <= 1.05) and gather / default.
4. Tokens held by L1 and L2 at CP=1 vs CP=2 for the same per-rank budgets (``--budget`` tokens of
   L1 per rank, L2 twice that), no L3: distinct prompts of ``--fill-tokens`` tokens, twice the CP=2
   node's L2 in all, then what each node's tiers hold.

The model is ``tests/helpers/long_prompts.py``'s tiny Llama (2 layers, hidden 64, 4 heads, 2 KV heads of 16,
float32: 512 B of KV per token; 132K rope positions), pages of 16 tokens, prefill chunks of 4096.

    .venv/bin/python benchmarks/long_context.py [--lengths 32768 131072] [--repeats 3] \\
        [--budget 16384] [--fill-tokens 4096] [--only ttft split held] [--split-nodes cp1_1t tp2 ...] [--logs DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' node helpers, reused

from helpers.long_prompts import PAGE, l3_flags, long_model, node_flags, start_node, stream, wait_backed_up  # noqa: E402
from helpers.processes import MasterProcess  # noqa: E402
from helpers.rank_servers import TPServer  # noqa: E402

CP_SIZES = (1, 2)
NEW_TOKENS = 4
WARM_UP_TOKENS = 2048
SETTLE_DEADLINE_S = 120.0
# The split part's nodes: CP size, OMP_NUM_THREADS of a CP=1 node (CP and TP ranks take cores / ranks each),
# flags (the last ``--tp-size`` wins: ``tp2`` is a TP=2 node, the same measure for tensor parallelism).
SPLIT_NODES = {"cp1_1t": (1, "1", ()), "cp1_2t": (1, "2", ()), "cp2": (2, None, ()),
               "cp2_gather": (2, None, ("--cp-attention", "gather")), "tp2": (1, None, ("--tp-size", "2"))}
SPLIT_RATIOS = {"cp2 / cp1_1t (equal per-rank threads; target <= 0.6)": ("cp2", "cp1_1t"),
                "cp2 / cp1_2t (equal total cores; target <= 1.05)": ("cp2", "cp1_2t"),
                "cp2_gather / cp2 (the seed's replicated compute / the split)": ("cp2_gather", "cp2"),
                "cp2_gather / cp1_2t (before the split, equal total cores)": ("cp2_gather", "cp1_2t"),
                "tp2 / cp1_1t (TP=2 / TP=1, equal per-rank threads; target <= 0.7)": ("tp2", "cp1_1t")}
GATHER = re.compile(r"^tierserve_cp_gather_(first|later)_(wait|span)_seconds_total (\S+)$", re.MULTILINE)
MERGE = re.compile(r"^tierserve_cp_merge_seconds_total (\S+)$", re.MULTILINE)


def prompt(tokens: int, seed: int) -> list[int]:
    """Random token ids: each seed a prompt no cache holds yet."""
    return torch.randint(2, 384, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def rotated(names: list[int], turn: int) -> list[int]:
    """``names`` starting at ``turn``, reversed every other cycle (as ``benchmarks/tp`` orders rounds)."""
    k = turn % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if (turn // len(names)) % 2 else order


def gauges(server: TPServer) -> dict[str, float]:
    """Every unlabelled ``tierserve_*`` sample of the node's ``/metrics`` (rank 0's engine)."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {k: float(v) for k, v in re.findall(r"^(tierserve_\w+) (\S+)$", text, re.MULTILINE)}


def gather_clock(server: TPServer) -> dict[str, float]:
    """``{first,later}_{wait,span}``: the gather clock's seconds so far, and ``merge``: the seconds
    in merged attention's all-gathers (empty at CP=1)."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    merge = MERGE.search(text)
    return {f"{k}_{w}": float(v) for k, w, v in GATHER.findall(text)} | ({"merge": float(merge[1])} if merge else {})


@dataclass
class TTFTNodes:
    """A writer and a reader node per CP size, and a one-thread CP=1 reader (``one_thread``), on one
    master. A CP=1 node's L1 holds the longest prompt; a CP=2 rank's L1 half of it (the node holds the
    same tokens)."""

    master: MasterProcess
    writers: dict[int, TPServer]
    readers: dict[int, TPServer]
    one_thread: TPServer | None = None

    @classmethod
    def start(cls, model: Path, logs: Path, longest: int) -> TTFTNodes:
        master = MasterProcess(logs / "mooncake_master.log").start()
        nodes = cls(master, {}, {})
        try:
            for cp in CP_SIZES:
                flags = l3_flags(master, longest // cp + 4096)
                nodes.writers[cp] = start_node(model, cp, logs / f"writer-cp{cp}.log", *flags)
                nodes.readers[cp] = start_node(model, cp, logs / f"reader-cp{cp}.log", *flags)
            with _threads("1"):
                nodes.one_thread = start_node(model, 1, logs / "reader-cp1_1t.log", *l3_flags(master, longest + 4096))
        except BaseException:
            nodes.stop()
            raise
        return nodes

    def stop(self) -> None:
        for node in [*self.readers.values(), *self.writers.values(), *([self.one_thread] if self.one_thread else [])]:
            node.stop()
        self.master.kill()


def timed_pair(nodes: TTFTNodes, model: Path, cp: int, ids: list[int], turn: int) -> dict[str, float]:
    """Uncached TTFT on the writer, then, once backed up, the TTFT from L3 on the reader (at CP=1 on
    both CP=1 readers, alternating which goes first); with each, at CP=2, the gather clock's change
    over it. Checks the answers agree and the L3 share."""
    sample: dict[str, float] = {}
    computed = _clocked(nodes.writers[cp], model, ids, sample, f"cp{cp}_uncached")
    wait_backed_up(nodes.master, model, ids)
    readers = {f"cp{cp}": nodes.readers[cp]} | ({"cp1_1t": nodes.one_thread} if cp == 1 and nodes.one_thread else {})
    for name in rotated(list(readers), turn):
        served = _clocked(readers[name], model, ids, sample, f"{name}_l3")
        if computed.tokens != served.tokens or served.tiers["storage"] < 0.95 * len(ids) // PAGE * PAGE:
            raise RuntimeError(f"{name}, {len(ids)} tokens: answers {computed.tokens} / {served.tokens}, "
                               f"from L3 {served.tiers}")
        sample[f"{name}_l3_share"] = served.tiers["storage"] / len(ids)
    return sample


def _clocked(server: TPServer, model: Path, ids: list[int], sample: dict[str, float], name: str):
    before = gather_clock(server)
    reply = stream(server, model, ids, NEW_TOKENS)
    after = gather_clock(server)
    sample[name] = reply.ttft_s
    sample |= {f"{name}_gather_{k}": after[k] - before[k] for k in after}
    return reply


def measure_ttft(model: Path, logs: Path, lengths: list[int], repeats: int) -> dict[int, list[dict[str, float]]]:
    """``{length: rounds}``; a warm-up round of short prompts first (not kept)."""
    nodes = TTFTNodes.start(model, logs, max(lengths))
    try:
        for cp in CP_SIZES:
            timed_pair(nodes, model, cp, prompt(WARM_UP_TOKENS, 1000 + cp), 0)
        out: dict[int, list[dict[str, float]]] = {n: [] for n in lengths}
        for turn in range(repeats):
            for n in lengths:
                sample: dict[str, float] = {}
                for cp in rotated(list(CP_SIZES), turn):
                    sample |= timed_pair(nodes, model, cp, prompt(n, n + 10 * turn + cp), turn)
                print(f"  {n} tokens, round {turn + 1}: " + ", ".join(f"{k} {v:.3g}" for k, v in sample.items()
                                                                    if "gather" not in k), flush=True)
                out[n].append(sample)
        return out
    finally:
        nodes.stop()


@contextlib.contextmanager
def _threads(count: str | None):
    """``OMP_NUM_THREADS`` for a node started inside (torch's default thread count; None: unset)."""
    before = os.environ.pop("OMP_NUM_THREADS", None)
    if count is not None:
        os.environ["OMP_NUM_THREADS"] = count
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if before is not None:
            os.environ["OMP_NUM_THREADS"] = before


def measure_split(model: Path, logs: Path, lengths: list[int], repeats: int, names: list[str]
                  ) -> dict[int, list[dict[str, float]]]:
    """``{length: rounds}`` of uncached TTFT per ``SPLIT_NODES`` node in ``names``; a warm-up round first."""
    nodes: dict[str, TPServer] = {}
    try:
        for name in names:
            cp, threads, flags = SPLIT_NODES[name]
            with _threads(threads):
                nodes[name] = start_node(model, cp, logs / f"split-{name}.log", *node_flags(max(lengths) // cp + 4096),
                                         *flags)
        _split_round(nodes, model, prompt(WARM_UP_TOKENS, 3000), 0)
        out: dict[int, list[dict[str, float]]] = {n: [] for n in lengths}
        for turn in range(repeats):
            for n in lengths:
                sample = _split_round(nodes, model, prompt(n, 3 * n + 17 * turn + 1), turn)
                print(f"  {n} tokens, round {turn + 1}: " + ", ".join(f"{k} {v:.3g}" for k, v in sample.items()),
                      flush=True)
                out[n].append(sample)
        return out
    finally:
        for node in nodes.values():
            node.stop()


def _split_round(nodes: dict[str, TPServer], model: Path, ids: list[int], turn: int) -> dict[str, float]:
    """The prompt's uncached TTFT on every node (rotating order); the answers must be equal."""
    sample, answers = {}, {}
    for name in rotated(list(nodes), turn):
        reply = stream(nodes[name], model, ids, NEW_TOKENS)
        sample[name], answers[name] = reply.ttft_s, reply.tokens
    if len({tuple(a) for a in answers.values()}) != 1:
        raise RuntimeError(f"{len(ids)} tokens: the nodes answered differently: {answers}")
    return sample


def split_report(results: dict[int, list[dict[str, float]]]) -> list[str]:
    names = [n for n in SPLIT_NODES if n in next(iter(results.values()))[0]]
    rows = [f"| prompt tokens | {' | '.join(f'{n} TTFT (s)' for n in names)} |", "|---:|" + "---:|" * len(names)]
    rows += [f"| {n} | {' | '.join(f'{med(rounds, k):.2f}' for k in names)} |" for n, rounds in results.items()]
    rows += ["", "| prompt tokens | ratio | median of per-round ratios |", "|---:|---|---:|"]
    for n, rounds in results.items():
        for label, (a, b) in SPLIT_RATIOS.items():
            if a not in names or b not in names:
                continue
            rows.append(f"| {n} | {label} | {statistics.median(r[a] / r[b] for r in rounds):.2f} |")
    return rows


def measure_held(model: Path, logs: Path, budget: int, fill_tokens: int) -> dict[int, dict[str, float]]:
    """What L1 and L2 hold (tokens) once distinct prompts worth twice the CP=2 node's L2 were sent,
    and their capacity, per CP size; every node with ``budget`` L1 tokens per rank, L2 twice that."""
    sent = 2 * 2 * budget * max(CP_SIZES)  # twice the CP=2 node's L2
    held = {}
    for cp in CP_SIZES:
        node = start_node(model, cp, logs / f"held-cp{cp}.log", "--enable-hierarchical-cache", "--hicache-ratio",
                          "2", *node_flags(budget))
        try:
            for i in range(sent // fill_tokens):
                stream(node, model, prompt(fill_tokens, 5000 + i), NEW_TOKENS)
            held[cp] = _settled(node)
        finally:
            node.stop()
    return held


def _settled(node: TPServer) -> dict[str, float]:
    """The tiers' tokens held and capacity, once no request runs and L2 stopped changing (the
    write-through copies end after the answers)."""
    deadline, last = time.monotonic() + SETTLE_DEADLINE_S, None
    while (g := gauges(node)) != last or g.get("tierserve_num_requests_running", 1):
        if time.monotonic() > deadline:
            raise RuntimeError("the node's cache gauges did not settle")
        last = g
        time.sleep(1.0)  # the stats are published at most once a second
    return {"l1": g["tierserve_kv_pages_cached"] * PAGE, "l1_total": g["tierserve_kv_pages_total"] * PAGE,
            "l2": g["tierserve_cache_host_pages_used"] * PAGE, "l2_total": g["tierserve_cache_host_pages_total"] * PAGE}


def med(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def ttft_report(results: dict[int, list[dict[str, float]]]) -> list[str]:
    rows = ["| prompt tokens | CP | TTFT uncached (s) | TTFT from L3 (s) | uncached / L3 | share from L3 |",
            "|---:|---:|---:|---:|---:|---:|"]
    for n, rounds in results.items():
        for cp in CP_SIZES:
            un, l3 = f"cp{cp}_uncached", f"cp{cp}_l3"
            speedup = statistics.median(r[un] / r[l3] for r in rounds)  # per-round ratio, side by side
            rows.append(f"| {n} | {cp} | {med(rounds, un):.2f} | {med(rounds, l3):.2f} "
                        f"| {speedup:.1f} | {med(rounds, l3 + '_share'):.3f} |")
    for n, rounds in results.items():
        for base, what in (("cp1", "equal total cores"), ("cp1_1t", "equal per-rank threads")):
            ratios = [r["cp2_l3"] / r[f"{base}_l3"] for r in rounds if f"{base}_l3" in r]
            if ratios:
                rows.append(f"\n{n} tokens, from L3, CP=2 / {base} ({what}; target <= 1): "
                            f"{statistics.median(ratios):.2f} (rounds {', '.join(f'{x:.2f}' for x in ratios)})")
    return rows


def gather_report(results: dict[int, list[dict[str, float]]]) -> list[str]:
    rows = ["| prompt tokens | request at CP=2 | layer 0: waited / span (s) | exposed | later layers: waited / "
            "span (s) | exposed | merge all-gathers (s) |", "|---:|---|---:|---:|---:|---:|---:|"]
    for n, rounds in results.items():
        for case in ("uncached", "l3"):
            cells = [_exposed(rounds, f"cp2_{case}_gather_{layer}") for layer in ("first", "later")]
            merge = med(rounds, f"cp2_{case}_gather_merge")
            rows.append(f"| {n} | {case} | {' | '.join(cells)} | {merge:.3f} |")
    return rows


def _exposed(rounds: list[dict[str, float]], key: str) -> str:
    """'waited / span | share' of one kind of gather; 'none' where no request gathered it."""
    spans = [r for r in rounds if r[f"{key}_span"]]
    if not spans:
        return "none | -"
    share = statistics.median(r[f"{key}_wait"] / r[f"{key}_span"] for r in spans)
    return f"{med(rounds, f'{key}_wait'):.3f} / {med(rounds, f'{key}_span'):.3f} | {share:.1%}"


def held_report(held: dict[int, dict[str, float]], budget: int) -> list[str]:
    rows = ["| CP | L1 tokens held / capacity | L2 tokens held / capacity | per-rank budget (L1, L2) |",
            "|---:|---:|---:|---|"]
    for cp, h in held.items():
        rows.append(f"| {cp} | {h['l1']:.0f} / {h['l1_total']:.0f} | {h['l2']:.0f} / {h['l2_total']:.0f} "
                    f"| {budget}, {2 * budget} |")
    ratio = {k: held[2][k] / held[1][k] for k in ("l1", "l2") if held[1][k]}
    return [*rows, "", "CP=2 / CP=1 tokens held: " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=16384, help="L1 tokens per rank for the tokens-held part")
    parser.add_argument("--fill-tokens", type=int, default=4096)
    parser.add_argument("--only", nargs="+", choices=["ttft", "split", "held"], default=["ttft", "split", "held"])
    parser.add_argument("--split-nodes", nargs="+", choices=list(SPLIT_NODES), default=list(SPLIT_NODES),
                        help="the split part's nodes (default: all; e.g. cp1_1t tp2 for TP=2 / TP=1 alone)")
    parser.add_argument("--logs", type=Path, default=None, help="node logs (default: a temporary folder)")
    args = parser.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="long-context-"))
    logs.mkdir(parents=True, exist_ok=True)
    model = long_model(logs / "llama-long")
    print(f"model {model}; logs in {logs}", flush=True)
    started, out = time.monotonic(), []
    if "ttft" in args.only:
        results = measure_ttft(model, logs, sorted(args.lengths), args.repeats)
        out += ["", "### TTFT, uncached vs from L3", "", *ttft_report(results),
                "", "### Per-layer gather left exposed (CP=2, rank 0)", "", *gather_report(results)]
    if "split" in args.only:
        split = measure_split(model, logs, sorted(args.lengths), args.repeats, args.split_nodes)
        out += ["", "### Uncached TTFT: the split of the compute (no L3)", "", *split_report(split)]
    if "held" in args.only:
        held = measure_held(model, logs, args.budget, args.fill_tokens)
        out += ["", "### Tokens held at the same per-rank budgets", "", *held_report(held, args.budget)]
    print("\n".join(out))
    print(f"\n(took {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
