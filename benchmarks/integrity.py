"""The cost of L3 object integrity (``cache/storage/integrity.py``): reads through our Mooncake
backend with trailers (``integrity`` on: each object read with its trailer, then its XXH3-128 digest
checked) against the same backend without them, on one real ``mooncake_master`` in the same run;
and the digest's throughput alone, next to BLAKE2b and CRC-32, for comparing with any bandwidth
(the PD handoff's included).

Pages have the built-in model's geometry (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64,
float32; 16 tokens: 720 KiB a page) and live in a real ``HostKVPool`` (page_first_direct), whose
pages have room for their trailer. Readers and writers are four clients with no segment: every
object lives in a fifth client's, so every read crosses the transfer engine (TCP here) alike, and no
reader reads what it wrote itself (Mooncake reads a client's own objects 5-15% slower). Each
repetition puts fresh keys, then reads them back in calls of ``--chunk`` pages (the prefetcher's),
the CPU caches flushed before each read, the ways in a rotating order:

- off: the client without trailers reading plain objects (the baseline of the first ratio);
- on: the checked read as built, each object one buffer (its trailer in its page's room);
- on, two buffers: the same with the room ignored, page and trailer as two buffers (the way
  before pages had room, still the way for spans outside a host pool);
- on, by phase: the one-buffer transfer and the check timed apart, call by call;
- same client, no trailers: the "on" client reading plain objects raw (the baseline of the second
  ratio: the same client, so only integrity differs).

Medians of ``--repeats``; overheads the median of each round's time ratio (the reads of a round
run within ~0.3 s).

    .venv/bin/python benchmarks/integrity.py [--pages 64] [--chunk 16] [--repeats 15]
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
from tierserve.cache.prefetch import CHUNK_PAGES
from tierserve.cache.storage.integrity import DIGEST_BYTES, PageRoom, span_digest, trailer_at
from tierserve.cache.storage.mooncake import MooncakeStorage

GEOMETRY = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype=torch.float32)
PAGE_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # layers, K and V, tokens, KV heads, head dim, float32
FLUSH_BYTES = 96 << 20  # written before each timed read: more than any last-level cache here


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


def check_alone(store: MooncakeStorage, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
    """The digests of pages ``transfer_only`` just read, against the trailers in their room."""
    names, (ptrs, sizes) = store._names(keys), store._locate(spans)
    return [span_digest(m.encode(), p, n) == trailer_at(p + n) for m, p, n in zip(names, ptrs, sizes, strict=True)]


class ByPhase:
    """The checked read in two timed phases per call, as ``_get_checked`` runs them: the
    one-buffer transfer, then the check of what just landed; ``check_s`` sums the checks."""

    __name__ = "by_phase"

    def __init__(self) -> None:
        self.check_s = 0.0

    def __call__(self, store: MooncakeStorage, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        landed = transfer_only(store, keys, spans)
        start = time.perf_counter()
        intact = check_alone(store, keys, spans)
        self.check_s += time.perf_counter() - start
        return [a and b for a, b in zip(landed, intact, strict=True)]


def same_client(store: MooncakeStorage, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
    """Plain objects (put by the "off" client) read raw by the "on" client."""
    names, (ptrs, sizes) = store._names(keys), store._locate(spans)
    return [c == n for c, n in zip(store._call(lambda s: s.batch_get_into(names, ptrs, sizes)), sizes, strict=True)]


def read_rounds(readers: dict[str, MooncakeStorage], writers: dict[str, MooncakeStorage], pages: torch.Tensor,
                repeats: int, chunk: int) -> dict[str, list[float]]:
    """Per (reader, way of reading): the seconds of each round's read of every page, in calls of
    ``chunk`` pages (as the prefetcher reads). Each round reads fresh keys in a rotating order, the
    CPU caches flushed before each read: the objects were written in one order, and the last ones
    written would otherwise still be in the last-level cache (a remote store's are not). Writers are
    other clients than the readers: a client reads objects it wrote itself 5-15% slower than
    another's (Mooncake; seen with plain objects on both sides), which is no part of integrity."""
    spans, scratch = list(pages), torch.zeros(FLUSH_BYTES, dtype=torch.uint8)
    by_phase = ByPhase()
    ways = [("off", one_call), ("on", one_call), ("on", two_buffers), ("on", by_phase), ("on", same_client)]
    times: dict[str, list[float]] = {f"on {phase}": [] for phase in ("transfer", "check")}
    times |= {f"{name} {way.__name__}": [] for name, way in ways}
    for r in range(repeats + 1):
        order = ways[r % len(ways):] + ways[: r % len(ways)]
        for name, way in order:
            writer = writers["off" if way is same_client else name]
            assert all(writer.batch_set_from(_keys(name, way, r, len(spans)), spans))
        for name, way in order:
            keys = _keys(name, way, r, len(spans))
            scratch.add_(1)
            by_phase.check_s, start = 0.0, time.perf_counter()
            ok = [good for at in range(0, len(keys), chunk)
                  for good in way(readers[name], keys[at : at + chunk], spans[at : at + chunk])]
            if r:  # the first round warms up
                times[f"{name} {way.__name__}"].append(time.perf_counter() - start)
            assert all(ok), name
            if r and way is by_phase:
                times["on check"].append(by_phase.check_s)
                times["on transfer"].append(times["on by_phase"][-1] - by_phase.check_s)
        readers["on"].clear()  # every client's objects
    return times


def _keys(name: str, way: Callable, r: int, n: int) -> list[bytes]:
    return [f"{name}{way.__name__}{r}-{i}".encode().ljust(32, b".") for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--chunk", type=int, default=CHUNK_PAGES, help="pages per call (the prefetcher's)")
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
            readers, writers = ({"on": MooncakeStorage(address, **config),
                                 "off": MooncakeStorage(address, integrity=False, **config)} for _ in range(2))
            pages = HostKVPool(GEOMETRY, args.pages, HostLayout.PAGE_FIRST_DIRECT).buffer
            for store in [*readers.values(), *writers.values()]:
                store.attach_host_buffer(pages)
            times = read_rounds(readers, writers, pages, args.repeats, args.chunk)
            for store in [*readers.values(), *writers.values(), holder]:
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
                       ("on by_phase", "on, by phase: transfer then check"),
                       ("on transfer", "of which the one-buffer transfer"),
                       ("on check", "of which the check (digests of what landed)"),
                       ("on same_client", "same client as on, objects without trailers")):
        share = way == "on check"  # a part of a read: its share of the baseline's time, not an overhead
        off, plain = (_overhead(times[way], times[base], share) for base in ("off one_call", "on same_client"))
        print(f"| {label} | {gb / statistics.median(times[way]):.2f} | {off} | {plain} |")


def _overhead(times: list[float], base: list[float], share: bool = False) -> str:
    """The median of the rounds' time ratios (paired: the reads of one round ran ~0.3 s apart),
    as an overhead, or with ``share`` as the fraction of the baseline's time."""
    ratio = statistics.median(a / b for a, b in zip(times, base, strict=True))
    return f"{100 * ratio:.1f}% of it" if share else f"{100 * (ratio - 1):+.1f}%"


if __name__ == "__main__":
    main()
