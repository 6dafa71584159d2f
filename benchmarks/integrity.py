"""The cost of L3 object integrity (``cache/storage/integrity.py``): reads through our Mooncake
backend with trailers (``integrity`` on: each object read into its page and a trailer slot, then
its XXH3-128 digest checked) against the same backend without them, on one real ``mooncake_master``
in the same run; and the digest's throughput alone, next to BLAKE2b and CRC-32, for comparing with
any bandwidth (the PD handoff's included).

Pages have the built-in model's geometry (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64,
float32; 16 tokens: 720 KiB a page). Each repetition puts fresh keys with both clients, then reads
them back with both, alternating which goes first; medians of ``--repeats``.

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
from pathlib import Path

import torch
import xxhash
from l3_store import start_master

from tierserve.cache.storage.mooncake import MooncakeStorage

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


def read_rounds(stores: dict[str, MooncakeStorage], pages: torch.Tensor, repeats: int) -> dict[str, list[float]]:
    spans, times = list(pages), {name: [] for name in stores}
    for r in range(repeats + 1):
        for name, store in stores.items():
            keys = [f"{name}{r}-{i}".encode().ljust(32, b".") for i in range(len(spans))]
            assert all(store.batch_set_from(keys, spans))
        order = list(stores.items()) if r % 2 else list(reversed(stores.items()))
        for name, store in order:
            keys = [f"{name}{r}-{i}".encode().ljust(32, b".") for i in range(len(spans))]
            start = time.perf_counter()
            ok = store.batch_get_into(keys, spans)
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - start)
            assert all(ok), name
        for store in stores.values():
            store.clear()
    return times


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
            config = {"global_segment_size": 2 * args.pages * PAGE_BYTES + (64 << 20), "local_buffer_size": 16 << 20}
            stores = {"on": MooncakeStorage(address, **config), "off": MooncakeStorage(address, integrity=False,
                                                                                       **config)}
            pages = torch.zeros(args.pages, PAGE_BYTES // 4)
            for store in stores.values():
                store.register_buffer(pages)
            times = read_rounds(stores, pages, args.repeats)
            for store in stores.values():
                store.close()
        finally:
            master.kill()
    gbps = {k: args.pages * PAGE_BYTES / statistics.median(v) / 1e9 for k, v in times.items()}
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"\nL3 reads, {args.pages} pages of {PAGE_BYTES >> 10} KiB per call: integrity off {gbps['off']:.2f} GB/s, "
          f"on {gbps['on']:.2f} GB/s; overhead {100 * (on / off - 1):+.1f}% (medians of {args.repeats})")


if __name__ == "__main__":
    main()
