"""Reading part of an L3 object in Mooncake, against reading whole objects (the choice in
``docs/tp.md``). A writer process stores 96 pages of 128 KiB (the
``benchmarks/tp`` model's TP=1 pages) and the same bytes as 192 half-pages; this process, a client
without a segment, reads them 16 pages per call, as two TP=2 ranks would (one after the other):

- ``whole``: one reader, whole pages (the TP=1 reader, the reference);
- ``halves``: each rank its half-page objects (what a writer told the cluster's TP sizes stores);
- ``whole_twice``: each rank the whole pages (what a TP=2 rank does without them, less the copy);
- ``ranges_N`` / ``session_N``: each rank its half of every whole page as N byte ranges, through
  ``get_into_ranges`` / a get session and ``batch_get_into_multi_buffer_ranges`` (N = 128: the
  page-first byte order, one run per layer, K/V and token; N = 1: a head-major order).

    .venv/bin/python benchmarks/tp/l3_ranges.py [--rounds 11]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tp_common import MasterProcess

from tierserve.cache.storage.mooncake import MooncakeStorage

PAGES, PAGE_BYTES, PER_CALL = 96, 128 << 10, 16
Read = Callable[[], None]


def serve_objects(master: str) -> None:
    """The writer: stores the pages whole and in halves (known bytes), then holds its segment."""
    store = MooncakeStorage(master, global_segment_size=256 << 20, local_buffer_size=16 << 20)
    data = torch.arange(PAGES * PAGE_BYTES // 4, dtype=torch.int32).view(PAGES, -1)
    store.register_buffer(data)
    assert all(store.batch_set_from([b"w%d" % i for i in range(PAGES)], list(data)))
    halves = data.view(PAGES * 2, -1)  # not the heads' bytes: only sizes matter here
    assert all(store.batch_set_from([b"h%d" % i for i in range(PAGES * 2)], list(halves)))
    print("ready", flush=True)
    time.sleep(3600)


def raw(store: MooncakeStorage) -> Any:
    """The Mooncake client itself: the backend wraps none of the ranged calls."""
    return store._store


def calls(store: MooncakeStorage, names: list[str], spans: list[tuple[int, int]]) -> None:
    """``names`` into ``spans`` (address, bytes), ``PER_CALL`` per call."""
    for at in range(0, len(names), PER_CALL):
        part = spans[at : at + PER_CALL]
        got = raw(store).batch_get_into(names[at : at + PER_CALL], [a for a, _ in part], [n for _, n in part])
        assert got == [n for _, n in part], got


def ranged(store: MooncakeStorage, names: list[str], dst: torch.Tensor, runs: int, session: bool) -> Read:
    """Each of two ranks reads its half of every whole page as ``runs`` ranges into ``dst[rank]``."""
    size, stride = PAGE_BYTES // 2 // runs, PAGE_BYTES // runs

    def read() -> None:
        for rank in (0, 1):
            for at in range(0, PAGES, PER_CALL):
                keys, pages = names[at : at + PER_CALL], range(at, min(at + PER_CALL, PAGES))
                src = [[j * stride + rank * size for j in range(runs)] for _ in pages]
                dsts = [[i * PAGE_BYTES // 2 + j * size for j in range(runs)] for i in pages]
                sizes = [[size] * runs for _ in pages]
                base = dst[rank].data_ptr()
                if session:
                    ptrs = [[base + d for d in row] for row in dsts]
                    got = _in_session(raw(store), keys, ptrs, sizes, src)
                    assert got == [size * runs] * len(keys), got
                else:
                    got = raw(store).get_into_ranges([base], [keys], [dsts], [src], [sizes])
                    assert all(n == size for key in got[0] for n in key), got[0][:1]
    return read


def _in_session(s: Any, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
                src: list[list[int]]) -> list[int]:
    s.batch_get_session_start(keys)
    try:
        return s.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, src)
    finally:
        s.batch_get_session_end(keys)


def cases(store: MooncakeStorage, host: torch.Tensor, ranks: torch.Tensor) -> dict[str, Read]:
    whole = [store.prefix + (b"w%d" % i).hex() for i in range(PAGES)]
    halves = [store.prefix + (b"h%d" % i).hex() for i in range(PAGES * 2)]
    whole_spans = [(host[i].data_ptr(), PAGE_BYTES) for i in range(PAGES)]
    half_spans = [[(ranks[r, i].data_ptr(), PAGE_BYTES // 2) for i in range(PAGES)] for r in (0, 1)]
    out: dict[str, Read] = {
        "whole": lambda: calls(store, whole, whole_spans),
        "halves": lambda: [calls(store, halves[r::2], half_spans[r]) for r in (0, 1)] and None,
        "whole_twice": lambda: [calls(store, whole, whole_spans) for _ in (0, 1)] and None,
    }
    for runs in (1, 8, 128):
        out[f"ranges_{runs}"] = ranged(store, whole, ranks, runs, session=False)
        out[f"session_{runs}"] = ranged(store, whole, ranks, runs, session=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11, help="the first is a warm-up")
    parser.add_argument("--writer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.writer:
        serve_objects(args.writer)
        return
    master = MasterProcess(Path(f"/tmp/l3_ranges_master_{time.time_ns()}.log")).start()
    writer = subprocess.Popen([sys.executable, __file__, "--writer", master.address], stdout=subprocess.PIPE)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == b"ready"
        store = MooncakeStorage(master.address, global_segment_size=0, local_buffer_size=16 << 20)
        host, ranks = torch.zeros(PAGES, PAGE_BYTES // 4, dtype=torch.int32), torch.zeros(2, PAGES, PAGE_BYTES // 8,
                                                                                          dtype=torch.int32)
        store.register_buffer(host)
        store.register_buffer(ranks)
        report(measure(cases(store, host, ranks), args.rounds))
        store.close()
    finally:
        writer.kill()
        master.kill()


def measure(reads: dict[str, Read], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in reads}
    for _ in range(rounds):
        for name, read in reads.items():
            start = time.perf_counter()
            read()
            times[name].append(time.perf_counter() - start)
    return {name: t[1:] for name, t in times.items()}


def report(times: dict[str, list[float]]) -> None:
    ref = statistics.median(times["whole"])
    print("| read | ms | whole / this |\n|---|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t) * 1e3:.2f} | {ref / statistics.median(t):.2f} |")


if __name__ == "__main__":
    main()
