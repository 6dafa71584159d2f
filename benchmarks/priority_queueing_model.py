"""What p99 TTFT can a high-priority class expect under overload, in a step-level model of one prefill
node (issue 33, item 5; benchmarks/RESULTS.md#priority-overload)? No cluster, no model: a simulation.

The node runs steps of one prefill chunk each, never interrupted (a step in flight finishes); a high
request's prompt is ``--chunks`` chunks; high requests arrive at Poisson times at ``rho`` of the node's
capacity and go first at every step boundary, in arrival order (``--schedule-policy priority``); under
overload low work is always waiting, so the node never idles and a high arrival first waits for the
step in flight. TTFT: arrival to the end of the step that finishes its prompt; unloaded: ``--chunks``
steps. Prints the p50 and p99 TTFT over the unloaded one, with and without the low work.

    python benchmarks/priority_queueing_model.py [--chunks 2] [--requests 200000]
"""

from __future__ import annotations

import argparse
import random
from collections import deque

RHOS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.6)


def arrivals(rho: float, chunks: int, n: int, seed: int) -> list[float]:
    """``n`` Poisson arrival times (in steps) of requests that load the node to ``rho``."""
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(n):
        at += rng.expovariate(rho / chunks)
        out.append(at)
    return out


def ttfts(rho: float, chunks: int, n: int, overloaded: bool, seed: int = 1) -> list[float]:
    """Each high request's TTFT in steps, sorted."""
    times, queue, out, i, now = arrivals(rho, chunks, n, seed), deque(), [], 0, 0.0
    while i < n or queue:
        if not queue and not overloaded and times[i] > now:
            now = times[i]  # an idle node starts the request at once
        while i < n and times[i] <= now:
            queue.append([times[i], chunks])
            i += 1
        now += 1.0  # one step: the head request's next chunk, or low work
        if queue:
            queue[0][1] -= 1
            if queue[0][1] == 0:
                out.append(now - queue.popleft()[0])
    return sorted(out)


def quantile(values: list[float], q: float) -> float:
    return values[int(q * (len(values) - 1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=2, help="a high prompt's chunks (256 tokens / 128 per step: 2)")
    p.add_argument("--requests", type=int, default=200000)
    args = p.parse_args()
    print("| high class load (rho) | p50 / p99 over unloaded, high class alone | same, under overload |")
    print("|---:|---:|---:|")
    for rho in RHOS:
        alone, loaded = (ttfts(rho, args.chunks, args.requests, over) for over in (False, True))
        ratios = [f"{quantile(t, 0.5) / args.chunks:.2f} / {quantile(t, 0.99) / args.chunks:.2f}"
                  for t in (alone, loaded)]
        print(f"| {rho} | {ratios[0]} | {ratios[1]} |")


if __name__ == "__main__":
    main()
