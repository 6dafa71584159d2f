"""The cost of L3 object integrity (``cache/storage/integrity.py``): reads through our Mooncake
backend with trailers (``integrity`` on: each object read with its trailer, then its XXH3-128 digest
checked) against the same backend without them, on one real ``mooncake_master`` in the same run;
and the digest's throughput alone, next to BLAKE2b and CRC-32, for comparing with any bandwidth
(the PD handoff's included).

Pages have the built-in model's geometry (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64,
float32; 16 tokens: 720 KiB a page) and live in a real ``HostKVPool`` (page_first_direct), whose
pages have room for their trailer. Both clients hold no segment: every object lives in a third
client's, so both read across the transfer engine (TCP here) alike. Each repetition puts fresh keys
with both clients, then reads them back, all pages in one call, in a rotating order:

- off: the client without trailers (the baseline of every ratio);
- on: the checked read as built, each object one buffer (its trailer in its page's room);
- on, two buffers: the same with the room ignored, page and trailer as two buffers (the way
  before pages had room, still the way for spans outside a host pool);
- on without its check: the one-buffer transfer alone (what the digests cost on top of it);
- same client, no trailers: the "on" client reading the "off" client's plain objects raw, so the
  difference between two clients shows (it is noise, not integrity).

Medians of ``--repeats``; overheads the median of each round's time ratio to "off" (the reads of a
round run within ~0.2 s).

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
from pathlib import Path

import torch
import xxhash
from l3_store import start_master

from tierserve.cache.device_pool import KVGeometry
from tierserve.cache.host_pool import HostKVPool, HostLayout
from tierserve.cache.storage.integrity import DIGEST_BYTES, PageRoom
from tierserve.cache.storage.mooncake import MooncakeStorage

GEOMETRY = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype=torch.float32)
PAGE_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # layers, K and V, tokens, KV heads, head dim, float32


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


def two_buffers(store: MooncakeStorage, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
    """The checked read with the pages' room ignored: page and trailer as two buffers."""
    store._room, room = PageRoom(), store._room
    try:
        return store.batch_get_into(keys, spans)
    finally:
        store._room = room


def transfer_only(store: MooncakeStorage, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
    """The "on" store's read without its check: each object into its page and the page's room."""
    names, (ptrs, sizes) = store._names(keys), store._locate(spans)
    codes = store._call(lambda s: s.batch_get_into(names, ptrs, [n + DIGEST_BYTES for n in sizes]))
    return [c == n + DIGEST_BYTES for c, n in zip(codes, sizes, strict=True)]


def same_client(store: MooncakeStorage, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
    """Plain objects (put by the "off" client) read raw by the "on" client."""
    names, (ptrs, sizes) = store._names(keys), store._locate(spans)
    return [c == n for c, n in zip(store._call(lambda s: s.batch_get_into(names, ptrs, sizes)), sizes, strict=True)]


def read_rounds(stores: dict[str, MooncakeStorage], pages: torch.Tensor, repeats: int) -> dict[str, list[float]]:
    """Per (store, way of reading): the seconds of each round's read of every page; each round
    reads fresh keys, the four reads in a rotating order."""
    spans = list(pages)
    ways = [("off", one_call), ("on", one_call), ("on", two_buffers), ("on", transfer_only), ("on", same_client)]
    times: dict[str, list[float]] = {f"{name} {way.__name__}": [] for name, way in ways}
    for r in range(repeats + 1):
        for name, way in ways:
            writer = stores["off" if way is same_client else name]
            assert all(writer.batch_set_from(_keys(name, way, r, len(spans)), spans))
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
            pages = HostKVPool(GEOMETRY, args.pages, HostLayout.PAGE_FIRST_DIRECT).buffer
            for store in stores.values():
                store.attach_host_buffer(pages)
            times = read_rounds(stores, pages, args.repeats)
            for store in [*stores.values(), holder]:
                store.close()
        finally:
            master.kill()
    print(f"\nL3 reads of {args.pages} pages of {PAGE_BYTES >> 10} KiB (medians of {args.repeats}; overhead: "
          "median of the rounds' time ratios)\n")
    print("| way | GB/s | time vs off (other client) | time vs same client, no trailers |\n|---|---:|---:|---:|")
    gb = args.pages * PAGE_BYTES / 1e9
    for way, label in (("off one_call", "off (no trailers)"),
                       ("on one_call", "on (one buffer each: trailer in the page's room)"),
                       ("on two_buffers", "on, two buffers (page, trailer slot): before"),
                       ("on transfer_only", "on without its check (one buffer)"),
                       ("on same_client", "same client as on, objects without trailers")):
        off, plain = _overhead(times[way], times["off one_call"]), _overhead(times[way], times["on same_client"])
        print(f"| {label} | {gb / statistics.median(times[way]):.2f} | {off} | {plain} |")


def _overhead(times: list[float], base: list[float]) -> str:
    """The median of the rounds' time ratios (paired: the reads of one round ran ~0.2 s apart)."""
    return f"{100 * (statistics.median(a / b for a, b in zip(times, base, strict=True)) - 1):+.1f}%"


if __name__ == "__main__":
    main()
