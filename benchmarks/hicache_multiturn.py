"""Multi-turn chat with a small L1: prefix hit rate and TTFT for L1 only, L1+L2, L1+L2+L3.

``--clients`` conversations of ``--rounds`` rounds, served one request at a time round-robin
(so each conversation's history was evicted from L1 by the others' before it returns); every
round sends the whole history plus a new question. Same seed, same prompts for every
configuration; the L3 is a fresh file store, prefetched with the ``timeout`` policy (requests
run alone here, so ``best_effort`` would never wait for a page).

The next request arrives as soon as the previous one finished (``--mode compete``, the default):
the background copies that one started (L1 -> L2 writes, L2 -> L3 backups) are still running and
compete with it, as in a server. ``--mode wait`` waits for them between requests instead (the
earlier method); ``--mode both`` runs every tiered configuration both ways in each repetition,
alternating which goes first (L1 only has no background copies: it runs once, mode "-"). Every
configuration runs ``--repeats`` times, the order of configurations reversed every other
repetition; reported are the medians over repetitions of each run's hit rate, TTFT median and
p90 (rounds 2+), and how many requests arrived while background copies were still in flight.

    .venv/bin/python benchmarks/hicache_multiturn.py [--model DIR] [--clients 4] [--rounds 4] [--repeats 3]
        [--mode compete|wait|both] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tierserve.cache.options import HiCacheOptions, PrefetchPolicy
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.model.fetch import fetch_builtin_model


def configs(l3_dir: str) -> dict[str, dict]:
    return {
        "L1 only": {},
        "L1+L2": {"enable_hierarchical_cache": True, "hicache": HiCacheOptions(ratio=2.0)},
        "L1+L2+L3": {"enable_hierarchical_cache": True, "hicache": HiCacheOptions(
            ratio=2.0, storage_backend="file", storage_config={"path": l3_dir, "prefetch_threshold": 64},
            prefetch_policy=PrefetchPolicy.TIMEOUT)},
    }


def serve(engine: Engine, prompt: list[int], answer: int) -> tuple[float, int, list[int]]:
    """(TTFT seconds, cached tokens, output ids) of one request; returns when it finished, with
    whatever background copies it started still running."""
    rid = f"r{time.monotonic_ns()}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=answer, temperature=0, ignore_eos=True))
    start, ttft, cached, out, finished = time.perf_counter(), None, 0, [], False
    while not finished:
        for o in engine.step():
            if o.request_id != rid:
                continue
            ttft = ttft if ttft is not None else time.perf_counter() - start
            cached, out, finished = o.cached_tokens, out + o.new_token_ids, o.finished
    return ttft, cached, out


def wait_background(engine: Engine) -> None:
    if hasattr(engine.cache, "wait_background"):
        engine.cache.wait_background()


def run(name: str, model: Path, extra: dict, args: argparse.Namespace, wait: bool) -> dict:
    engine = Engine(EngineConfig(model, dtype="float32", page_size=16, max_total_tokens=args.l1_tokens, **extra))
    rng = random.Random(args.seed)
    questions = [[[rng.randrange(100, 40_000) for _ in range(args.question)] for _ in range(args.rounds)]
                 for _ in range(args.clients)]
    history: list[list[int]] = [[] for _ in range(args.clients)]
    ttfts, cached, prompt_tokens, competing = [], 0, 0, 0
    for r in range(args.rounds):
        for c in range(args.clients):
            prompt = history[c] + questions[c][r]
            busy = engine.cache.busy  # background copies still in flight as this request arrives
            ttft, hit, out = serve(engine, prompt, args.answer)
            if r:  # the first round has nothing to reuse in any configuration
                ttfts.append(ttft)
                cached, prompt_tokens, competing = cached + hit, prompt_tokens + len(prompt), competing + busy
            history[c] = prompt + out
            if wait:
                wait_background(engine)
    wait_background(engine)  # untimed: leave nothing running behind this engine
    q = statistics.quantiles(ttfts, n=10)
    return {"name": name, "hit": cached / prompt_tokens, "median": statistics.median(ttfts), "p90": q[-1],
            "competing": competing, "requests": len(ttfts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--question", type=int, default=160)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--l1-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of every configuration, order alternating")
    ap.add_argument("--mode", choices=["compete", "wait", "both"], default="compete",
                    help="compete: the next request arrives while background copies run; wait: they finish "
                         "between requests (the earlier method); both: each way, side by side")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: torch's default); 1 holds up better on a loaded machine")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or fetch_builtin_model()
    modes = ["compete", "wait"] if args.mode == "both" else [args.mode]
    runs: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        names = list(configs("")) if rep % 2 == 0 else list(configs(""))[::-1]
        order = modes if rep % 2 == 0 else modes[::-1]
        for name in names:
            for mode in order if name != "L1 only" else ["-"]:  # L1 only has no background copies
                with tempfile.TemporaryDirectory() as l3:  # a fresh L3 for every run
                    row = run(name, model, configs(l3)[name], args, mode == "wait")
                runs.setdefault((name, mode), []).append(row)
                print(f"repetition {rep}: {name} ({mode}): hit {row['hit']:.1%}, TTFT median "
                      f"{row['median']:.3f}s, p90 {row['p90']:.3f}s, {row['competing']}/{row['requests']} "
                      "arrived during background copies", flush=True)
    print(f"\nmodel={model.name} clients={args.clients} rounds={args.rounds} question={args.question} "
          f"answer={args.answer} L1={args.l1_tokens} tokens, L2=2x L1, rounds 2+ (per run: medians over requests); "
          f"torch threads={torch.get_num_threads()}; medians of {args.repeats} runs; between requests: "
          "compete = background copies still running, "
          "wait = waited for\n")
    print("| configuration | between requests | prefix hit rate | TTFT median (s) | TTFT p90 (s) "
          "| TTFT median vs L1 only | arrived during copies | per run: TTFT median (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    base = runs[("L1 only", "-")]
    for (name, mode), rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in ("hit", "median", "p90", "competing")}
        ratio = statistics.median(r["median"] / b["median"] for r, b in zip(rows, base, strict=True))
        print(f"| {name} | {mode} | {med['hit']:.1%} | {med['median']:.3f} | {med['p90']:.3f} | {ratio:.2f} "
              f"| {med['competing']:.0f}/{rows[0]['requests']} | " + ", ".join(f"{r['median']:.3f}" for r in rows)
              + " |")


if __name__ == "__main__":
    main()
