"""L1 <-> L2 copy bandwidth per host layout and I/O backend, as a fraction of plain memcpy.

Moves the KV of ``--pages`` scattered pages of the built-in model's geometry (float32) each way
and compares with one ``copy_`` of the same number of bytes between two contiguous buffers.
The machine is shared and noisy, so every timed copy is paired with a memcpy timed just before
it and the ratio is taken per pair: medians of ``--repeats`` pairs.

By default the host pool has exactly ``--pages`` pages, so the host ids are a permutation of the
whole pool; ``--host-pages`` larger than that leaves the host side fragmented too. ``--layerwise``
copies one layer per call (``layers=range(i, i + 1)``), as overlapped L2 -> L1 loads do.

    .venv/bin/python benchmarks/host_copy.py [--pages 256] [--page-size 16] [--repeats 7]
        [--host-pages N] [--layerwise] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.host_pool import HostKVPool, HostLayout, IOBackend, copy_pages


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired(fn: Callable[[], object], memcpy: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of ``fn`` and median of memcpy-time / fn-time over back-to-back pairs."""
    fn()
    times, ratios = [], []
    for _ in range(repeats):
        ref = _seconds(memcpy)
        times.append(_seconds(fn))
        ratios.append(ref / times[-1])
    return statistics.median(times), statistics.median(ratios)


def copier(device: DeviceKVPool, host: HostKVPool, dev_ids: list[int], host_ids: list[int], to_host: bool,
           backend: IOBackend, layerwise: bool) -> Callable[[], None]:
    if not layerwise:
        return partial(copy_pages, device, host, dev_ids, host_ids, to_host, backend)
    layers = [range(i, i + 1) for i in range(device.geometry.num_layers)]
    return lambda: [copy_pages(device, host, dev_ids, host_ids, to_host, backend, r) for r in layers]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--host-pages", type=int, default=0, help="host pool size (default: --pages)")
    ap.add_argument("--layerwise", action="store_true", help="one copy_pages call per layer")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    host_pages = args.host_pages or args.pages
    geometry = KVGeometry(30, 3, 64, args.page_size, torch.float32)  # SmolLM2-135M
    device = DeviceKVPool(geometry, args.pages * 2, torch.device("cpu"))
    rng = random.Random(0)
    dev_ids = rng.sample(range(args.pages * 2), args.pages)
    host_ids = rng.sample(range(host_pages), args.pages)
    nbytes = geometry.bytes_per_page * args.pages
    a = torch.empty(nbytes // 4)
    b = torch.randn(nbytes // 4)
    memcpy = partial(a.copy_, b)
    seconds, _ = paired(memcpy, memcpy, args.repeats)
    print(f"{args.pages} pages x {geometry.bytes_per_page / 2**20:.2f} MiB = {nbytes / 2**20:.0f} MiB each way; "
          f"host pool {host_pages} pages; {'layer-wise' if args.layerwise else 'all layers per call'}; "
          f"{torch.get_num_threads()} threads; "
          f"memcpy {nbytes / seconds / 1e9:.2f} GB/s (median of {args.repeats}; ratios are per pair)\n")
    print("| layout | backend | L1->L2 GB/s | L2->L1 GB/s | L1->L2 / memcpy | L2->L1 / memcpy |")
    print("|---|---|---:|---:|---:|---:|")
    for layout in HostLayout:
        host = HostKVPool(geometry, host_pages, layout)
        for backend in IOBackend:
            (t_out, r_out), (t_back, r_back) = (
                paired(copier(device, host, dev_ids, host_ids, to_host, backend, args.layerwise), memcpy, args.repeats)
                for to_host in (True, False)
            )
            print(f"| {layout.value} | {backend.value} | {nbytes / t_out / 1e9:.2f} | {nbytes / t_back / 1e9:.2f} | "
                  f"{r_out:.2f} | {r_back:.2f} |", flush=True)


if __name__ == "__main__":
    main()
