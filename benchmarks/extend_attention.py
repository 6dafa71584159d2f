"""A prompt chunk's attention over its prefix, as ``PagedAttention._extend`` computes it on the CPU (issue 28):
the masked form (one ``[chunk, prefix + chunk]`` mask, ``masked_extend``) against the split form (the prefix
unmasked and the chunk causal, merged by log-sum-exp, ``split_extend``), pages gathered from a pool included.

1. ``kernel``: one chunk of ``--chunk`` tokens over a ``--prefix``-token prefix (default: the last 4096-token
   chunk of a 32K prompt), at TP=1's heads (``--heads`` / ``--kv-heads``) and at one TP=2 rank's (half of
   each), old and new form: medians of ``--repeats`` rounds, the four in rotating order.
2. ``threshold``: old / new time for short prefixes (``--short-prefixes``) and chunks (``--short-chunks``) at
   TP=1's heads: where the split form stops paying (``MIN_SPLIT_PREFIX`` in ``model/attention.py``).

One thread (``torch.set_num_threads(1)``: a rank's share here), float32, head dim 16, pages of 16 tokens:
the tests' long-prompt Llama (``tests/helpers/long_prompts.py``).

    PYTHONPATH=src .venv/bin/python benchmarks/extend_attention.py [--only kernel threshold] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tierserve.model.attention import AttentionBatch, ExtendSpan, masked_extend, prefix_keys, split_extend

PAGE = 16
DIM = 16


class Case:
    """One chunk over a prefix in a pool of its own pages, at some head counts."""

    def __init__(self, prefix: int, chunk: int, heads: int, kv_heads: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        total = prefix + chunk
        pages = -(-total // PAGE)
        self.pool = [torch.randn(pages * PAGE, kv_heads, DIM, generator=g) for _ in range(2)]
        self.q = torch.randn(chunk, heads, DIM, generator=g)
        self.new = [p[prefix:total] for p in self.pool]
        self.span = ExtendSpan(0, chunk, prefix, torch.arange(pages))
        self.batch = AttentionBatch(PAGE, torch.arange(prefix, total))
        self.scale = DIM**-0.5

    def old(self) -> torch.Tensor:
        return masked_extend(self.q, self.span, self.batch, (self.new[0], self.new[1]),
                             (self.pool[0], self.pool[1]), self.scale)

    def new_form(self) -> torch.Tensor:
        k, v = (prefix_keys(p, self.span, PAGE) for p in self.pool)
        return split_extend(self.q, self.new[0], self.new[1], k, v, self.scale)


def timed(fn: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rounds(fns: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, list[float]]:
    """Each function once per round, in rotating order, after one untimed call each."""
    for fn in fns.values():
        fn()
    names, out = list(fns), {n: [] for n in fns}
    for r in range(repeats):
        for n in names[r % len(names):] + names[: r % len(names)]:
            out[n].append(timed(fns[n]))
    return out


def kernel(args: argparse.Namespace) -> None:
    tp1 = Case(args.prefix, args.chunk, args.heads, args.kv_heads)
    tp2 = Case(args.prefix, args.chunk, args.heads // 2, args.kv_heads // 2)
    diff = (tp1.old() - tp1.new_form()).abs().max().item()
    times = rounds({"tp1 old": tp1.old, "tp1 new": tp1.new_form, "tp2 old": tp2.old, "tp2 new": tp2.new_form},
                   args.repeats)
    print(f"chunk {args.chunk} over prefix {args.prefix}, {args.repeats} rounds (max |old - new| {diff:.2e})")
    for name, ts in times.items():
        print(f"  {name}: median {statistics.median(ts):.3f} s  rounds {' '.join(f'{t:.3f}' for t in ts)}")
    med = {n: statistics.median(ts) for n, ts in times.items()}
    print(f"  TP=2 rank / TP=1: old {med['tp2 old'] / med['tp1 old']:.2f}, new {med['tp2 new'] / med['tp1 new']:.2f}")
    print(f"  new / old: TP=1 {med['tp1 new'] / med['tp1 old']:.2f}, TP=2 {med['tp2 new'] / med['tp2 old']:.2f}")
    print(f"  TP=2 new / TP=1 old {med['tp2 new'] / med['tp1 old']:.2f}")


def threshold(args: argparse.Namespace) -> None:
    print(f"old / new (medians of {args.repeats} rounds), TP=1 heads; rows: prefix tokens, columns: chunk tokens")
    print("| prefix | " + " | ".join(f"chunk {c}" for c in args.short_chunks) + " |")
    for prefix in args.short_prefixes:
        cells = []
        for chunk in args.short_chunks:
            case = Case(prefix, chunk, args.heads, args.kv_heads)
            times = rounds({"old": case.old, "new": case.new_form}, args.repeats)
            old, new = (statistics.median(times[n]) for n in ("old", "new"))
            cells.append(f"{old / new:.2f} ({old * 1e3:.2f} / {new * 1e3:.2f} ms)")
        print(f"| {prefix} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=["kernel", "threshold"], default=["kernel", "threshold"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefix", type=int, default=32768 - 4096)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--short-prefixes", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 4096])
    parser.add_argument("--short-chunks", type=int, nargs="+", default=[1, 16, 256, 4096])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if "kernel" in args.only:
        kernel(args)
    if "threshold" in args.only:
        threshold(args)


if __name__ == "__main__":
    main()
