"""L1 <-> L2 copy bandwidth per host layout and I/O backend, as a fraction of plain memcpy.

Moves the KV of ``--pages`` scattered pages of the built-in model's geometry (float32) each way
and compares with one ``copy_`` of the same number of bytes between two contiguous buffers,
measured in the same run. Medians of ``--repeats``.

    .venv/bin/python benchmarks/host_copy.py [--pages 256] [--page-size 16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from functools import partial

import torch

from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.host_pool import HostKVPool, HostLayout, IOBackend, copy_pages


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    geometry = KVGeometry(30, 3, 64, args.page_size, torch.float32)  # SmolLM2-135M
    device = DeviceKVPool(geometry, args.pages * 2, torch.device("cpu"))
    rng = random.Random(0)
    dev_ids = rng.sample(range(args.pages * 2), args.pages)
    host_ids = rng.sample(range(args.pages), args.pages)
    nbytes = geometry.bytes_per_page * args.pages
    a = torch.empty(nbytes // 4)
    b = torch.randn(nbytes // 4)
    memcpy = nbytes / timed(lambda: a.copy_(b), args.repeats) / 1e9
    print(f"{args.pages} pages x {geometry.bytes_per_page / 2**20:.2f} MiB = {nbytes / 2**20:.0f} MiB each way; "
          f"memcpy {memcpy:.2f} GB/s (median of {args.repeats})\n")
    print("| layout | backend | L1->L2 GB/s | L2->L1 GB/s | L1->L2 / memcpy | L2->L1 / memcpy |")
    print("|---|---|---:|---:|---:|---:|")
    for layout in HostLayout:
        host = HostKVPool(geometry, args.pages, layout)
        for backend in IOBackend:
            out, back = (
                nbytes / timed(partial(copy_pages, device, host, dev_ids, host_ids, to_host, backend), args.repeats)
                / 1e9 for to_host in (True, False)
            )
            print(f"| {layout.value} | {backend.value} | {out:.2f} | {back:.2f} | "
                  f"{out / memcpy:.2f} | {back / memcpy:.2f} |", flush=True)


if __name__ == "__main__":
    main()
