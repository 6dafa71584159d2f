"""Multi-turn chat with a small L1: prefix hit rate and TTFT for L1 only, L1+L2, L1+L2+L3.

``--clients`` conversations of ``--rounds`` rounds, served one request at a time round-robin
(so each conversation's history was evicted from L1 by the others' before it returns); every
round sends the whole history plus a new question. Same seed, same prompts for every
configuration; the L3 is a fresh file store, prefetched with the ``timeout`` policy (requests
run alone here, so ``best_effort`` would never wait for a page).

    .venv/bin/python benchmarks/hicache_multiturn.py [--model DIR] [--clients 4] [--rounds 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

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
    """(TTFT seconds, cached tokens, output ids) of one request run alone."""
    engine.add_request(f"r{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=answer, temperature=0,
                                                                          ignore_eos=True))
    start, ttft, cached, out = time.perf_counter(), None, 0, []
    while engine.has_work():
        for o in engine.step():
            ttft = ttft if ttft is not None else time.perf_counter() - start
            cached, out = o.cached_tokens, out + o.new_token_ids
    return ttft, cached, out


def run(name: str, model: Path, extra: dict, args: argparse.Namespace) -> dict:
    engine = Engine(EngineConfig(model, dtype="float32", page_size=16, max_total_tokens=args.l1_tokens, **extra))
    rng = random.Random(args.seed)
    questions = [[[rng.randrange(100, 40_000) for _ in range(args.question)] for _ in range(args.rounds)]
                 for _ in range(args.clients)]
    history: list[list[int]] = [[] for _ in range(args.clients)]
    ttfts, cached, prompt_tokens = [], 0, 0
    for r in range(args.rounds):
        for c in range(args.clients):
            prompt = history[c] + questions[c][r]
            ttft, hit, out = serve(engine, prompt, args.answer)
            if r:  # the first round has nothing to reuse in any configuration
                ttfts.append(ttft)
                cached, prompt_tokens = cached + hit, prompt_tokens + len(prompt)
            history[c] = prompt + out
            if hasattr(engine.cache, "wait_background"):  # let background copies land between turns
                engine.cache.wait_background()
    q = statistics.quantiles(ttfts, n=10)
    return {"name": name, "hit": cached / prompt_tokens, "median": statistics.median(ttfts), "p90": q[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--question", type=int, default=160)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--l1-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = args.model or fetch_builtin_model()
    with tempfile.TemporaryDirectory() as l3:
        rows = [run(name, model, extra, args) for name, extra in configs(l3).items()]
    print(f"model={model.name} clients={args.clients} rounds={args.rounds} question={args.question} "
          f"answer={args.answer} L1={args.l1_tokens} tokens, L2=2x L1, rounds 2+ (medians over requests)\n")
    print("| configuration | prefix hit rate | TTFT median (s) | TTFT p90 (s) | TTFT median vs L1 only |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['name']} | {row['hit']:.1%} | {row['median']:.3f} | {row['p90']:.3f} | "
              f"{row['median'] / rows[0]['median']:.2f} |")


if __name__ == "__main__":
    main()
