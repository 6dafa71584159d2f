"""Cache-aware vs round-robin routing of prefill: hit rate and TTFT on a multi-turn workload.

Starts 2 prefill nodes (publishing KV events) and 1 decode node on the built-in model, then, for
each policy, a router in front of them, and runs the same conversations through it: every turn
sends the whole history (system prompt, earlier questions and answers) plus a new question, one
request at a time, round-robin over conversations. Both routers run side by side on the same
nodes; every run gets its own ``cache_salt`` (policy and repetition), so no run reuses another's
KV although they share the nodes.

Method: first a warm-up through each router (a few requests under their own salt, so both prefill
nodes and the decode node have run the model before anything is timed), then ``--repeats``
repetitions of both policies, alternating which goes first. Reported: per policy, the medians over
repetitions of each run's hit rate, TTFT median and TTFT p90, and the median of the per-repetition
ratios cache_aware / round_robin.

    .venv/bin/python benchmarks/routing.py [--conversations 5] [--turns 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tierserve.launch import free_port, grpc_serving, http_ok
from tierserve.model.fetch import fetch_builtin_model

NODE = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "16384", "--kv-events-port", "0",
        "--log-level", "warning"]
TOPICS = ["the history of Rome", "how rainbows form", "the rules of chess", "why the sky is blue",
          "how vaccines work", "the life of bees", "how airplanes fly", "the French revolution"]


def start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tierserve.cli", *args], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)


def wait(ready, what: str, deadline_s: float = 300) -> None:
    deadline = time.monotonic() + deadline_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)  # poll interval


POLICIES = ("round_robin", "cache_aware")


def conversation(client: httpx.Client, url: str, history: list[dict], salt: str, max_tokens: int
                 ) -> tuple[float, int, int, str]:
    """One streamed chat turn: (TTFT seconds, prompt tokens, cached tokens, answer)."""
    body = {"messages": history, "max_tokens": max_tokens, "temperature": 0, "stream": True, "cache_salt": salt,
            "stream_options": {"include_usage": True}}
    start, ttft, text, usage = time.perf_counter(), None, [], None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(choice["delta"]["content"])
    return ttft or 0.0, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], "".join(text)


def run(url: str, salt: str, conversations: int, turns: int, max_tokens: int, quiet: bool = False
        ) -> dict[str, float]:
    rng = random.Random(0)
    system = {"role": "system", "content": "You are a patient teacher who explains things step by step. " * 12}
    histories = [[system] for _ in range(conversations)]
    ttfts, prompt, cached = [], 0, 0
    with httpx.Client() as client:
        for turn in range(turns):
            for c, history in enumerate(histories):
                history.append({"role": "user", "content": f"Tell me more about {rng.choice(TOPICS)} (turn {turn})."})
                ttft, p, k, answer = conversation(client, url, history, salt, max_tokens)
                history.append({"role": "assistant", "content": answer})
                ttfts.append(ttft)
                prompt, cached = prompt + p, cached + k
                if not quiet:
                    print(f"  {salt}: conversation {c} turn {turn}: prompt {p}, cached {k}, ttft {ttft:.3f}s",
                          flush=True)
    return {"hit": cached / prompt, "ttft_median": statistics.median(ttfts),
            "ttft_p90": statistics.quantiles(ttfts, n=10)[-1] if len(ttfts) > 1 else ttfts[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each policy, alternating which goes first")
    parser.add_argument("--max-tokens", type=int, default=24, help="answer length")
    args = parser.parse_args()
    model, logs = fetch_builtin_model(progress=True), Path(tempfile.mkdtemp())
    ports = [free_port() for _ in range(3)]
    procs = [start(["prefill", "--model", str(model), "--port", str(ports[0]), *NODE], logs / "p0.log"),
             start(["prefill", "--model", str(model), "--port", str(ports[1]), *NODE], logs / "p1.log"),
             start(["decode", "--model", str(model), "--port", str(ports[2]), *NODE], logs / "d.log")]
    results: dict[str, list[dict[str, float]]] = {policy: [] for policy in POLICIES}
    try:
        for port in ports:
            wait(lambda p=port: grpc_serving(p), f"node on {port}")
        urls = {}
        for policy in POLICIES:
            http = free_port()
            procs.append(start(["router", "--model", str(model), "--port", str(http),
                                "--prefill", f"127.0.0.1:{ports[0]}", "--prefill", f"127.0.0.1:{ports[1]}",
                                "--decode", f"127.0.0.1:{ports[2]}", "--prefill-policy", policy,
                                "--log-level", "warning"], logs / f"{policy}.log"))
            urls[policy] = f"http://127.0.0.1:{http}"
        for policy, url in urls.items():
            wait(lambda u=url: http_ok(f"{u}/readiness"), f"{policy} router")
        for policy, url in urls.items():  # warm-up: every node runs the model before anything is timed
            warm = run(url, f"warmup-{policy}", 2, 2, args.max_tokens, quiet=True)
            print(f"warm-up through {policy}: ttft median {warm['ttft_median']:.3f}s", flush=True)
        for rep in range(args.repeats):
            order = POLICIES if rep % 2 == 0 else POLICIES[::-1]
            for policy in order:
                r = run(urls[policy], f"{policy}-{rep}", args.conversations, args.turns, args.max_tokens, quiet=True)
                results[policy].append(r)
                print(f"repetition {rep} ({' then '.join(order)}): {policy}: hit {r['hit']:.2f}, "
                      f"ttft median {r['ttft_median']:.3f}s, p90 {r['ttft_p90']:.3f}s", flush=True)
    finally:
        for proc in reversed(procs):  # routers first
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    print(f"\n{args.conversations} conversations x {args.turns} turns, 2 prefill nodes + 1 decode node; "
          f"medians over {args.repeats} repetitions (alternating order) of each run's figures\n")
    print("| prefill policy | hit rate | TTFT median (s) | TTFT p90 (s) | per run: TTFT median (s) |")
    print("|---|---:|---:|---:|---|")
    for policy, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"| {policy} | {med['hit']:.2f} | {med['ttft_median']:.3f} | {med['ttft_p90']:.3f} | "
              + ", ".join(f"{r['ttft_median']:.3f}" for r in runs) + " |")
    pairs = list(zip(results["cache_aware"], results["round_robin"], strict=True))
    for key, label in (("ttft_median", "TTFT median"), ("ttft_p90", "TTFT p90")):
        ratios = [ca[key] / rr[key] for ca, rr in pairs]
        print(f"\ncache_aware / round_robin, {label}: median {statistics.median(ratios):.2f} "
              f"(per repetition: {', '.join(f'{x:.2f}' for x in ratios)})", end="")
    print()


if __name__ == "__main__":
    main()
