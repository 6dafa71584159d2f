"""Cache-aware vs round-robin routing of prefill: hit rate and TTFT on a multi-turn workload.

Starts 2 prefill nodes (publishing KV events) and 1 decode node on the built-in model, then, for
each policy, a router in front of them, and runs the same conversations through it: every turn
sends the whole history (system prompt, earlier questions and answers) plus a new question, one
request at a time, round-robin over conversations. Each policy gets its own ``cache_salt``, so
the two runs share no cached KV although they share the nodes.

    .venv/bin/python benchmarks/routing.py [--conversations 5] [--turns 4]
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


def conversation(client: httpx.Client, url: str, history: list[dict], salt: str) -> tuple[float, int, int, str]:
    """One streamed chat turn: (TTFT seconds, prompt tokens, cached tokens, answer)."""
    body = {"messages": history, "max_tokens": 24, "temperature": 0, "stream": True, "cache_salt": salt,
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


def run(url: str, salt: str, conversations: int, turns: int) -> dict[str, float]:
    rng = random.Random(0)
    system = {"role": "system", "content": "You are a patient teacher who explains things step by step. " * 12}
    histories = [[system] for _ in range(conversations)]
    ttfts, prompt, cached = [], 0, 0
    with httpx.Client() as client:
        for turn in range(turns):
            for c, history in enumerate(histories):
                history.append({"role": "user", "content": f"Tell me more about {rng.choice(TOPICS)} (turn {turn})."})
                ttft, p, k, answer = conversation(client, url, history, salt)
                history.append({"role": "assistant", "content": answer})
                ttfts.append(ttft)
                prompt, cached = prompt + p, cached + k
                print(f"  {salt}: conversation {c} turn {turn}: prompt {p}, cached {k}, ttft {ttft:.3f}s", flush=True)
    return {"hit": cached / prompt, "ttft_median": statistics.median(ttfts),
            "ttft_p90": statistics.quantiles(ttfts, n=10)[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    model, logs = fetch_builtin_model(progress=True), Path(tempfile.mkdtemp())
    ports = [free_port() for _ in range(3)]
    procs = [start(["prefill", "--model", str(model), "--port", str(ports[0]), *NODE], logs / "p0.log"),
             start(["prefill", "--model", str(model), "--port", str(ports[1]), *NODE], logs / "p1.log"),
             start(["decode", "--model", str(model), "--port", str(ports[2]), *NODE], logs / "d.log")]
    results = {}
    try:
        for port in ports:
            wait(lambda p=port: grpc_serving(p), f"node on {port}")
        for policy in ("round_robin", "cache_aware"):
            http = free_port()
            router = start(["router", "--model", str(model), "--port", str(http), "--prefill", f"127.0.0.1:{ports[0]}",
                            "--prefill", f"127.0.0.1:{ports[1]}", "--decode", f"127.0.0.1:{ports[2]}",
                            "--prefill-policy", policy, "--log-level", "warning"], logs / f"{policy}.log")
            try:
                wait(lambda h=http: http_ok(f"http://127.0.0.1:{h}/readiness"), "router")
                results[policy] = run(f"http://127.0.0.1:{http}", policy, args.conversations, args.turns)
            finally:
                router.terminate()
                router.wait(30)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    print(f"\n{args.conversations} conversations x {args.turns} turns, 2 prefill nodes + 1 decode node\n")
    print("| prefill policy | hit rate | TTFT median (s) | TTFT p90 (s) |\n|---|---:|---:|---:|")
    for policy, r in results.items():
        print(f"| {policy} | {r['hit']:.2f} | {r['ttft_median']:.3f} | {r['ttft_p90']:.3f} |")


if __name__ == "__main__":
    main()
