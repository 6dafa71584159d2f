"""The cost of L3 object integrity (``cache/storage/integrity.py``): reads through our Mooncake
backend with trailers (``integrity`` on: each object read into its page and a trailer slot, then
its XXH3-128 digest checked) against the same backend without them, on one real ``mooncake_master``
in the same run; and the digest's throughput alone, next to BLAKE2b and CRC-32, for comparing with
any bandwidth (the PD handoff's included).

Pages have the built-in model's geometry (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64,
float32; 16 tokens: 720 KiB a page). Both clients hold no segment: every object lives in a third
client's, so both read across the transfer engine (TCP here) alike. Each repetition puts fresh keys
with both clients, then reads
them back, in a rotating order: all pages in one call (both clients, and the "on" client without
its check), and in calls of 16 pages with two in flight (both clients: does overlapping one call's
digest check with the next call's transfer pay?); medians of ``--repeats``, overheads the median
of each round's time ratio (the two reads of a round ran seconds apart).

    .venv/bin/python benchmarks/integrity.py [--pages 64] [--repeats 15]
    .venv/bin/python benchmarks/integrity.py --handoff [--tokens 2048] [--repeats 15]

``--handoff`` measures the PD handoff's digests instead (``--handoff-integrity``,
``benchmarks/handoff_integrity.py``): a handoff with and without them, against its bandwidth.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import xxhash
from l3_store import start_master

from tierserve.cache.storage.mooncake import MooncakeStorage

PAGE_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # layers, K and V, tokens, KV heads, head dim, float32
AHEAD = ThreadPoolExecutor(max_workers=2)


def digest_gbps(name: str, data: memoryview, repeats: int) -> float:
    fn = {"xxh3_128": lambda: xxhash.xxh3_128(data).digest(), "blake2b": lambda: hashlib.blake2b(data).digest(),
          "crc32": lambda: zlib.crc32(data)}[name]
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return len(data) / statistics.median(times) / 1e9


def one_call(store: MooncakeStorage, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
    return store.batch_get_into(keys, spans)


def transfer_only(store: MooncakeStorage, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
    """The "on" store's read without its check: each object into its page and trailer slot (two
    buffers), what the check costs on top of this is the digests."""
    names, (ptrs, sizes) = store._names(keys), store._locate(spans)
    with store._trailers.lend() as base:
        codes = store._call(lambda s: s.batch_get_into_multi_buffers(names, *store._parts(ptrs, sizes, base)))
    return [c > 0 for c in codes]


def read_ahead(store: MooncakeStorage, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
    """Calls of 16 pages (a prefetch's, ``cache/prefetch.py``) with two in flight, so one's store
    call may overlap the other's digest check: an experiment (the prefetch reads one at a time)."""
    calls = [AHEAD.submit(store.batch_get_into, keys[i : i + 16], spans[i : i + 16]) for i in range(0, len(keys), 16)]
    return [ok for call in calls for ok in call.result()]


def read_rounds(stores: dict[str, MooncakeStorage], pages: torch.Tensor, repeats: int) -> dict[str, list[float]]:
    """Per (store, way of reading): the seconds of each round's read of every page; each round
    reads fresh keys, the four reads in a rotating order."""
    spans = list(pages)
    ways = [("off", one_call), ("on", one_call), ("on", transfer_only), ("off", read_ahead), ("on", read_ahead)]
    times: dict[str, list[float]] = {f"{name} {way.__name__}": [] for name, way in ways}
    for r in range(repeats + 1):
        for name, way in ways:
            assert all(stores[name].batch_set_from(_keys(name, way, r, len(spans)), spans))
        for name, way in ways[r % len(ways):] + ways[: r % len(ways)]:
            keys = _keys(name, way, r, len(spans))
            start = time.perf_counter()
            ok = way(stores[name], keys, spans)
            if r:  # the first round warms up
                times[f"{name} {way.__name__}"].append(time.perf_counter() - start)
            assert all(ok), name
        for store in stores.values():
            store.clear()
    return times


def _keys(name: str, way: Callable, r: int, n: int) -> list[bytes]:
    return [f"{name}{way.__name__}{r}-{i}".encode().ljust(32, b".") for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--handoff", action="store_true", help="the PD handoff's digests instead of L3 reads")
    parser.add_argument("--tokens", type=int, default=2048, help="with --handoff: the prompt's length")
    args = parser.parse_args()
    if args.handoff:
        from handoff_integrity import measure_handoff

        measure_handoff(args.tokens, args.repeats)
        return
    data = memoryview(torch.randn(PAGE_BYTES * args.pages // 4).numpy()).cast("B")
    print("| digest | GB/s (one core) |\n|---|---|")
    for name in ("xxh3_128", "blake2b", "crc32"):
        print(f"| {name} | {digest_gbps(name, data, args.repeats):.1f} |")
    with tempfile.TemporaryDirectory() as folder:
        master, address = start_master(Path(folder) / "master.log")
        try:
            # Every object lives in the holder's segment, so both readers (no segment of their own)
            # read across the transfer engine alike, as from another node; none is the other's.
            holder = MooncakeStorage(address, global_segment_size=8 * args.pages * PAGE_BYTES + (64 << 20))
            config = {"global_segment_size": 0, "local_buffer_size": 16 << 20}
            stores = {"on": MooncakeStorage(address, **config), "off": MooncakeStorage(address, integrity=False,
                                                                                       **config)}
            pages = torch.zeros(args.pages, PAGE_BYTES // 4)
            for store in stores.values():
                store.register_buffer(pages)
            times = read_rounds(stores, pages, args.repeats)
            for store in [*stores.values(), holder]:
                store.close()
        finally:
            master.kill()
    print(f"\nL3 reads of {args.pages} pages of {PAGE_BYTES >> 10} KiB (medians of {args.repeats}; overhead: "
          "median of the rounds' time ratios)\n")
    print("| way | integrity off GB/s | on GB/s | time overhead |\n|---|---:|---:|---:|")
    gb = args.pages * PAGE_BYTES / 1e9
    for way, label in (("one_call", "one call"), ("transfer_only", "one call, on without its check (two buffers)"),
                       ("read_ahead", "16-page calls, two in flight")):
        base = times["off read_ahead" if way == "read_ahead" else "off one_call"]
        on = times[f"on {way}"]
        ratio = statistics.median(a / b for a, b in zip(on, base, strict=True))  # paired: the same round
        print(f"| {label} | {gb / statistics.median(base):.2f} | {gb / statistics.median(on):.2f} | "
              f"{100 * (ratio - 1):+.1f}% |")


if __name__ == "__main__":
    main()
