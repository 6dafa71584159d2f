"""Conditional disaggregation: where the threshold lies, and what it gives a multi-turn chat.

Starts 1 prefill node and 1 decode node (KV events on) on the built-in model (CPU, float32) and
two routers over the same nodes: one always through the prefill node (``--disaggregation-threshold
0``), one with a threshold (``--threshold``, default: the router's default). Every run has its own
``cache_salt``, so the routers never share KV although they share the nodes.

``calibrate``: for uncached prompts of each length in ``--lengths`` (random token ids), the TTFT
of a streamed 2-token completion always through the prefill node vs always on the decode node
(a router with an unreachable threshold), alternating, ``--repeats`` each; medians. The local
prefill's compute (its TTFT minus the shortest length's, a step of one token) is what every stream
running on the decode node waits meanwhile; the PD path's extra (PD TTFT minus local TTFT) is
what the request pays for avoiding that. Rule for the threshold: a local prefill may delay the
decode node's running streams by at most one decode step (the shortest length's TTFT), as
admitting any new request into a continuous batch does: the threshold is the first length whose
compute exceeds that (the table's first "no").

``chat``: ``--conversations`` conversations of ``--turns`` turns, one request at a time, each turn
the whole history (a long system prompt, earlier questions and answers) plus a short new question,
streamed; conversations alternate between the two routers turn by turn. Reported: the follow-up
turns' (turn > 0) TTFT median per router and their ratio, the first turns' too, the paths the
threshold router took, and for the follow-ups it served on the decode node alone, their TTFT
against the same turns' always-PD TTFT.

    .venv/bin/python benchmarks/disaggregation.py calibrate [--lengths 1 16 32 64 128 256] [--repeats 7]
    .venv/bin/python benchmarks/disaggregation.py chat [--conversations 6] [--turns 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' process helpers, reused
from helpers.processes import NodeProcess, RouterProcess  # noqa: E402

from tierserve.model.fetch import fetch_builtin_model  # noqa: E402
from tierserve.router.disaggregation import DEFAULT_THRESHOLD  # noqa: E402

NODE = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "32768", "--log-level", "warning",
        "--kv-events-port", "0"]
QUESTIONS = ["Why is that?", "Can you give an example?", "And what happens next?", "Is that always true?",
             "How would you explain it to a child?", "What is the most common mistake?", "Say more."]
NEVER = 1 << 30  # a threshold no prompt reaches: always on the decode node


class Cluster:
    """The nodes and one router per threshold."""

    def __init__(self, thresholds: dict[str, int], logs: Path) -> None:
        self.model = fetch_builtin_model(progress=True)
        self.prefill = NodeProcess("prefill", ["--model", str(self.model), *NODE], logs / "p.log")
        self.decode = NodeProcess("decode", ["--model", str(self.model), *NODE], logs / "d.log")
        self.routers: dict[str, RouterProcess] = {}
        self.prefill.wait_ready()
        self.decode.wait_ready()
        for name, threshold in thresholds.items():
            self.routers[name] = RouterProcess(
                ["--model", str(self.model), "--prefill", self.prefill.address, "--decode", self.decode.address,
                 "--disaggregation-threshold", str(threshold), "--log-level", "warning"], logs / f"{name}.log")
        for router in self.routers.values():
            router.wait_ready()

    def stop(self) -> None:
        for proc in (*self.routers.values(), self.prefill, self.decode):
            proc.stop()


def ttft_of_tokens(client: httpx.Client, url: str, prompt: list[int], salt: str) -> float:
    """Seconds to the first streamed token of a 2-token completion (one token would skip the
    decode node: the prefill-only path)."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "cache_salt": salt,
            "stream": True}
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                return time.perf_counter() - start
    raise RuntimeError("no token came")


def calibrate(cluster: Cluster, lengths: list[int], repeats: int) -> None:
    rng, ms = random.Random(0), {name: {n: [] for n in lengths} for name in cluster.routers}
    with httpx.Client() as client:
        for router in cluster.routers.values():  # warm-up
            ttft_of_tokens(client, router.url, [rng.randrange(2, 40000) for _ in range(32)], "warm")
        for rep in range(repeats):
            for n in lengths:
                for name in (list(cluster.routers) if rep % 2 == 0 else list(cluster.routers)[::-1]):
                    prompt = [rng.randrange(2, 40000) for _ in range(n)]
                    ms[name][n].append(1000 * ttft_of_tokens(client, cluster.routers[name].url, prompt, f"c{rep}"))
    med = {name: {n: statistics.median(v) for n, v in by.items()} for name, by in ms.items()}
    base = med["local"][lengths[0]]
    print(f"\nuncached prompt tokens: TTFT ms (medians of {repeats}), always-PD vs decode node alone")
    print("  tokens   pd      local   local compute   pd extra   compute <= one step")
    for n in lengths:
        pd, local = med["pd"][n], med["local"][n]
        print(f"  {n:6d}  {pd:7.1f}  {local:7.1f}  {local - base:13.1f}  {pd - local:9.1f}   "
              f"{'yes' if local - base <= base else 'no'}")


def chat_turn(client: httpx.Client, url: str, history: list[dict], salt: str, max_tokens: int
              ) -> tuple[float, str]:
    body = {"messages": history, "max_tokens": max_tokens, "temperature": 0, "stream": True, "cache_salt": salt}
    start, ttft, text = time.perf_counter(), None, []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(choice["delta"]["content"])
    return ttft or 0.0, "".join(text)


def chat(cluster: Cluster, conversations: int, turns: int, max_tokens: int) -> None:
    rng = random.Random(1)
    system = {"role": "system", "content": "You are a patient teacher who explains things step by step. " * 12}
    names = list(cluster.routers)
    first: dict[str, list[float]] = {n: [] for n in names}
    later: dict[str, list[float]] = {n: [] for n in names}
    local: list[tuple[float, float]] = []  # follow-ups the conditional router served locally: (pd, conditional)
    histories = {(n, c): [system] for n in names for c in range(conversations)}
    with httpx.Client() as client:
        for name in names:  # warm-up
            chat_turn(client, cluster.routers[name].url, [system, {"role": "user", "content": "Hi"}], "warm", 4)
        for turn in range(turns):
            for c in range(conversations):
                question = f"Tell me about topic {c}." if turn == 0 else rng.choice(QUESTIONS)
                ttfts = {}
                for name in (names if (turn + c) % 2 == 0 else names[::-1]):
                    history = histories[name, c]
                    history.append({"role": "user", "content": question})
                    ttft, answer = chat_turn(client, cluster.routers[name].url, history, f"{name}-{c}", max_tokens)
                    history.append({"role": "assistant", "content": answer})
                    (later if turn else first)[name].append(1000 * ttft)
                    ttfts[name] = 1000 * ttft
                if turn and last_path(cluster.routers["conditional"]) == "decode_only":
                    local.append((ttfts["pd"], ttfts["conditional"]))
    state = httpx.get(f"{cluster.routers['conditional'].url}/debug/state").json()
    print(f"\n{conversations} conversations x {turns} turns, answers of {max_tokens} tokens; TTFT medians (ms):")
    for name in names:
        print(f"  {name:12s} first turns {statistics.median(first[name]):7.1f}   "
              f"follow-ups {statistics.median(later[name]):7.1f}")
    ratio = statistics.median(later["conditional"]) / statistics.median(later["pd"])
    print(f"  follow-ups' TTFT median, conditional / always-PD: {ratio:.2f}")
    print(f"  paths of the conditional router: {state['served']} (with the warm-up)")
    if local:
        pd, cond = statistics.median(p for p, _ in local), statistics.median(c for _, c in local)
        paired = statistics.median(c / p for p, c in local)
        print(f"  the {len(local)} follow-ups it served on the decode node alone: TTFT median {cond:.1f} ms vs "
              f"{pd:.1f} ms for the same turns always-PD (median of paired ratios {paired:.2f})")


def last_path(router: RouterProcess) -> str:
    return httpx.get(f"{router.url}/debug/state").json()["routes"][-1]["path"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["calibrate", "chat"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 16, 32, 48, 64, 96, 128, 256, 512])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threshold", type=int, default=DEFAULT_THRESHOLD)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=24, help="answer length")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="disaggregation-"))
    third = {"local": NEVER} if args.what == "calibrate" else {"conditional": args.threshold}
    cluster = Cluster({"pd": 0, **third}, logs)
    try:
        if args.what == "calibrate":
            calibrate(cluster, args.lengths, args.repeats)
        else:
            chat(cluster, args.conversations, args.turns, args.max_tokens)
    finally:
        cluster.stop()
    print(f"(logs: {logs})")


if __name__ == "__main__":
    main()
