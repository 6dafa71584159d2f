"""Where a long prompt's prefill time goes, per rank, at CP=1, CP=2 (the split) and TP=2 (issue 28).

Each layout's ranks are real engines over gloo (``tests/helpers/rank_agreement.py``'s spawned ranks,
no HTTP), run one after the other, alternating order between rounds, on the same fresh prompt of
``--tokens`` tokens (chunks of 4096, pages of 16, ``long_context.py``'s tiny Llama). Inside each rank
process only, the phases of a step are wrapped with ``perf_counter`` spans (monkeypatched here, so the
product carries no profiling code): the model's projections, MLP, norms and rope; attention and, in a
split step, its parts (the K/V exchange, the prefix gather's wait and start, the owners' pool writes,
the copy of the prefix's keys, the kernel calls); TP's all-reduces; sampling and the step's agreement.
Each rank's process CPU time is recorded beside its wall time (on shared cores, wall minus CPU is time
the rank was blocked or waiting for a core). Every exchange's seconds are kept per call on every rank:
the two ranks' times of one all-gather differ by how long the earlier rank waited for the later one
(imbalance); the smaller is the transfer.

    PYTHONPATH=src .venv/bin/python benchmarks/cp_profile.py [--tokens 32768] [--repeats 3] [--layouts cp1 cp2 tp2]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' rank helpers, reused

from helpers.long_prompts import CHUNK, PAGE, long_model  # noqa: E402
from helpers.rank_agreement import rank_reports, report_and_leave, run_agreed  # noqa: E402

# layout: (cp_size, tp_size, ranks' intra-op threads); every rank one thread, as a GPU rank has its own device
LAYOUTS = {"cp1": (1, 1), "cp2": (2, 1), "tp2": (1, 2), "cp2_gather": (2, 1)}
TIMEOUT_S = 600.0
# (module path, attribute path, span name): the spans each rank records (inclusive seconds)
SPANS = [
    ("tierserve.engine.engine", "Engine.step", "step"),
    ("tierserve.engine.model_runner", "ModelRunner.run", "run"),
    ("tierserve.model.llama", "CausalLM.forward", "forward"),
    ("tierserve.model.layers", "Embedding.forward", "embed"),
    ("tierserve.model.layers", "RMSNorm.forward", "norms"),
    ("tierserve.model.layers", "ColumnParallelLinear.forward", "qkv"),
    ("tierserve.model.layers", "RowParallelLinear.forward", "o_proj+down"),
    ("tierserve.model.layers", "GatedMLP.forward", "mlp"),
    ("tierserve.model.parallel", "TensorParallel.all_reduce", "tp_all_reduce"),
    ("tierserve.model.rope", "RotaryEmbedding.apply", "rope"),
    ("tierserve.model.attention", "PagedAttention.forward", "attention"),
    ("tierserve.model.attention", "split_extend", "kernel"),
    ("tierserve.model.attention", "prefix_keys", "prefix_copy"),
    ("tierserve.engine.cp.gather", "LayerGather.before_attention", "gather_wait+start"),
    ("tierserve.engine.cp.gather", "LayerGather._start", "gather_start"),
    ("tierserve.engine.cp.gather", "LayerGather.after_kv_written", "pool_writes"),
    ("tierserve.engine.cp.gather", "LayerGather.__init__", "step_buffer"),
    ("tierserve.engine.cp.split", "SplitAttention._exchange", "exchange"),  # before the overlap: synchronous
    ("tierserve.engine.cp.split", "SplitAttention._finish_exchange", "exchange_wait"),  # since: its wait
    ("tierserve.engine.cp.split", "SplitAttention._local_parts", "early_parts"),
    ("tierserve.engine.cp.split", "unmasked_cpu", "kernel"),
    ("tierserve.engine.cp.split", "causal_cpu", "kernel"),
    ("tierserve.engine.cp.split", "_prefix", "prefix_copy"),
    ("tierserve.engine.cp.split", "_before", "prefix_copy"),
    ("tierserve.engine.cp.split", "split_extend", "kernel"),
    ("tierserve.engine.cp.split", "_sdpa", "kernel"),
    ("tierserve.engine.cp.split", "SplitAttention._store", "pool_writes"),
    ("tierserve.engine.cp.runner", "CPRunner.step", "cp_plan"),
]
PER_CALL = {"exchange", "exchange_wait", "gather_wait+start"}  # kept per call: the ranks' imbalance


class Spans:
    """Inclusive seconds per span name, and per call for ``PER_CALL``; nested spans of one name
    (a kernel called inside a kernel) count once."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.open: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args: object, **kwargs: object) -> object:
            self.open[name] += 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.open[name] -= 1
                if not self.open[name]:
                    spent = time.perf_counter() - started
                    self.seconds[name] += spent
                    if name in PER_CALL:
                        self.calls[name].append(spent)
        return timed

    def install(self) -> None:
        import importlib
        for module_name, path, name in SPANS:
            owner = importlib.import_module(module_name)
            *parents, attr = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            if hasattr(owner, attr):
                setattr(owner, attr, self.wrap(name, getattr(owner, attr)))

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def _rank(rank: int, port: int, model: str, layout: str, prompts: list[list[int]], out: str) -> None:
    import torch.distributed as dist

    from tierserve.engine.config import CPAttention, EngineConfig
    from tierserve.engine.engine import Engine
    from tierserve.engine.procs.ranks import HOST, RankSpec, join

    cp, tp = LAYOUTS[layout]
    size = cp * tp
    config = EngineConfig(Path(model), device="cpu", dtype="float32", page_size=PAGE, chunked_prefill_size=CHUNK,
                          max_total_tokens=max(len(p) for p in prompts) // cp + 4096, cp_size=cp, tp_size=tp,
                          cp_attention=CPAttention.GATHER if layout == "cp2_gather" else CPAttention.MERGE,
                          dist_timeout_s=TIMEOUT_S)
    if size == 1:
        torch.set_num_threads(1)
        engine = Engine(config)
    else:
        store = dist.TCPStore(HOST, port, size, is_master=True, wait_for_workers=False) if rank == 0 else None
        engine = Engine(config, ranks=join(RankSpec(rank, size, port, TIMEOUT_S), config, store))
    spans = Spans()
    spans.install()
    run_agreed(engine, "warm-up", prompts[0])
    rounds = []
    for i, ids in enumerate(prompts[1:]):
        spans.reset()
        started, cpu = time.perf_counter(), time.process_time()
        tokens, _ = run_agreed(engine, f"timed-{i}", ids)
        rounds.append({"wall": time.perf_counter() - started, "cpu": time.process_time() - cpu, "tokens": tokens,
                       "seconds": dict(spans.seconds), "calls": dict(spans.calls)})
    report = {"threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(), "rounds": rounds}
    if size == 1:
        Path(out).write_text(json.dumps(report))
    else:
        report_and_leave(engine, out, report)


def prompt(tokens: int, seed: int) -> list[int]:
    return torch.randint(2, 384, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_layout(model: Path, layout: str, prompts: list[list[int]], folder: Path) -> list[dict]:
    cp, tp = LAYOUTS[layout]
    folder.mkdir(parents=True)
    return rank_reports(_rank, lambda rank, port, out: (rank, port, str(model), layout, prompts, out), cp * tp,
                        folder, TIMEOUT_S * 2)


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each layout's ranks start once per round")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=["cp1", "cp2", "tp2"])
    parser.add_argument("--out", type=Path, default=None, help="JSON of every rank's spans (default: a temp file)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="cp-profile-"))
    model = long_model(folder / "llama-long")
    results: dict[str, list[list[dict]]] = defaultdict(list)  # layout -> rounds -> ranks
    for turn in range(args.repeats):
        order = args.layouts if turn % 2 == 0 else args.layouts[::-1]
        ids = [prompt(2048, 1), prompt(args.tokens, 100 + turn)]
        for layout in order:
            print(f"round {turn + 1}, {layout}: load average {loadavg()}", flush=True)
            reports = run_layout(model, layout, ids, folder / f"{layout}-{turn}")
            results[layout].append([r["rounds"][0] | {"threads": r["threads"]} for r in reports])
            walls = ", ".join(f"{r['rounds'][0]['wall']:.2f}" for r in reports)
            print(f"  wall {walls} s, threads {[r['threads'] for r in reports]}", flush=True)
        answers = {tuple(results[name][-1][0]["tokens"]) for name in args.layouts}
        if len(answers) != 1:
            raise RuntimeError(f"the layouts answered differently: {answers}")
    out = args.out or folder / "profile.json"
    out.write_text(json.dumps(results))
    print(f"load average at the end {loadavg()}; spans in {out}\n")
    print("\n".join(report(results)))


def report(results: dict[str, list[list[dict]]]) -> list[str]:
    """Medians over rounds, per layout and rank, of every span's seconds, and the exchanges' imbalance."""
    names = sorted({k for rounds in results.values() for ranks in rounds for r in ranks for k in r["seconds"]})
    columns = [(layout, rank) for layout, rounds in results.items() for rank in range(len(rounds[0]))]
    rows = [f"| span (s, median of {len(next(iter(results.values())))} rounds) | "
            + " | ".join(f"{layout} r{rank}" for layout, rank in columns) + " |",
            "|---|" + "---:|" * len(columns)]
    walls = [statistics.median(ranks[rank]["wall"] for ranks in results[layout]) for layout, rank in columns]
    rows.append("| wall (the prompt's steps) | " + " | ".join(f"{w:.3f}" for w in walls) + " |")
    cpus = [statistics.median(ranks[rank]["cpu"] for ranks in results[layout]) for layout, rank in columns]
    rows.append("| CPU time of the rank's process | " + " | ".join(f"{c:.3f}" for c in cpus) + " |")
    for name in names:
        rows.append(f"| {name} | " + " | ".join(
            f"{statistics.median(ranks[rank]['seconds'].get(name, 0.0) for ranks in results[layout]):.3f}"
            for layout, rank in columns) + " |")
    for layout, rounds in results.items():
        for name in PER_CALL:
            if len(rounds[0]) == 2 and name in rounds[0][0]["calls"]:
                rows.append(_imbalance(layout, name, rounds))
    return rows


def _imbalance(layout: str, name: str, rounds: list[list[dict]]) -> str:
    """Per round, summed over the calls: the smaller of the two ranks' times (transfer) and the difference."""
    low, gap = [], []
    for ranks in rounds:
        pairs = list(zip(ranks[0]["calls"][name], ranks[1]["calls"][name], strict=True))
        low.append(sum(min(a, b) for a, b in pairs))
        gap.append(sum(abs(a - b) for a, b in pairs))
    return (f"\n{layout} {name}: {len(pairs)} calls per prompt; both ranks in it (transfer) "
            f"{statistics.median(low):.3f} s, one rank waiting for the other (imbalance) "
            f"{statistics.median(gap):.3f} s")


if __name__ == "__main__":
    main()
