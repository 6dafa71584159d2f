"""Radix tree match + insert throughput on the public Mooncake conversation trace.

Each record's ``hash_ids`` become token blocks (one deterministic block of ``--block`` tokens per
hash id, so shared ids give shared prefixes); every request is matched, then inserted with fresh
page numbers, in an unlimited L1 (no eviction), as a prefix cache would see it. Prints requests/s,
pages/s and the prefix hit rate (the trace's best possible, since nothing is evicted).

    .venv/bin/python benchmarks/tree_trace.py [--block 16] [--page-size 16] [--limit 5606]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from tierserve.cache.radix_tree import RadixTree

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_first_half.jsonl"


def block_tokens(hash_id: int, block: int) -> list[int]:
    rng = random.Random(hash_id)
    return [rng.randrange(100, 49_000) for _ in range(block)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--block", type=int, default=16, help="tokens per hash id (the trace's 512, scaled)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    records = [json.loads(line) for line in args.trace.read_text().splitlines()[: args.limit]]
    blocks: dict[int, list[int]] = {}
    prompts = []
    for r in records:
        tokens = []
        for h in r["hash_ids"]:
            tokens += blocks.setdefault(h, block_tokens(h, args.block))
        prompts.append(tokens)
    tree = RadixTree(args.page_size, b"\0" * 32)
    next_page, hit_pages, total_pages = 0, 0, 0
    start = time.perf_counter()
    for tokens in prompts:
        found = tree.match(tokens)
        pages = len(tokens) // args.page_size
        hit_pages += len(found.device_pages)
        total_pages += pages
        new = list(range(next_page, next_page + pages - len(found.device_pages)))
        next_page += len(new)
        tree.insert(tokens[: pages * args.page_size], found.device_pages + new)
    elapsed = time.perf_counter() - start
    print(f"{len(prompts)} requests, {total_pages} pages of {args.page_size} tokens "
          f"({args.block} tokens per trace block) in {elapsed:.2f} s: "
          f"{len(prompts) / elapsed:.0f} requests/s, {total_pages / elapsed:.0f} pages/s; "
          f"prefix hit rate {hit_pages / total_pages:.1%} (unlimited cache)")


if __name__ == "__main__":
    main()
