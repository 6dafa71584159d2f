"""L3 put/get through our Mooncake backend (``MooncakeStorage``) vs raw Mooncake Store calls.

Starts a real ``mooncake_master`` on free loopback ports, opens one ``MooncakeStorage`` client and
moves the same pages both ways, in the same run, through

- ours: ``batch_set_from(keys, spans)`` / ``batch_get_into(keys, spans)`` with 32-byte page keys
  and page spans of a ``page_first_direct`` host pool (what the storage tier passes), and
- raw:  ``MooncakeDistributedStore.batch_put_from(names, ptrs, sizes)`` /
  ``batch_get_into(names, ptrs, sizes)`` with precomputed names (same length) and addresses,
  on the *same* client (the one inside our backend), so both hit the same segment and engine.

The backup path (``StorageTier._write``) is measured too, both ways, through our backend and the
storage tier's ``DirectPageIO``: (a) ``batch_exists`` first, then a put of only the missing pages
(what every backend did before ``put_skips_existing``; still the path of backends whose put of a
stored key is not a cheap no-op) and (b) a plain put of all pages (the path for Mooncake since
``put_skips_existing``), each on new pages (fresh keys) and then again on the same pages, which
exist by then.

Pages have the built-in model's geometry (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64,
float32). Every repetition puts fresh keys and gets them back; the calls of each group (puts on
new pages: ours, raw, (a), (b); puts on existing pages: (a), (b); gets: ours, raw) rotate which
goes first; every key is cleared after each repetition (untimed). Reported: medians of
``--repeats`` (after one warm-up), GB/s both ways and the overhead ``ours / raw time - 1``; a
scenario of N < 64 pages per call repeats up to 4x more (``min(4, ceil(64 / N))``). A second
table splits what our backend does per call beyond the raw call, timed against a stub store that
answers at once, and the ``batch_is_exist`` RPC alone; a third compares (a) and (b).

    .venv/bin/python benchmarks/l3_store.py [--scenarios 16:64 64:16 16:16 16:4 16:1] [--repeats 21]

A scenario ``P:N`` is page size P tokens, N pages per batch call: 16:64 and 64:16 move the same
45 MiB per call as many small or fewer large objects; 16:16, 16:4 and 16:1 are short nodes'
backups, where the fixed cost per call shows.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from tierserve.cache.device_pool import KVGeometry
from tierserve.cache.host_pool import HostKVPool, HostLayout
from tierserve.cache.staging import DirectPageIO
from tierserve.cache.storage.mooncake import MooncakeStorage

OURS_PREFIX = "tierserve/"
RAW_PREFIX = "rawstore0/"  # same length: master RPCs carry the names
OPS = ("put_ours", "put_raw", "plain_new", "backup_new", "plain_existing", "backup_existing", "exists",
       "get_ours", "get_raw")
_KEEP: list[HostKVPool] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master(log: Path) -> tuple[subprocess.Popen, str]:
    binary = str(Path(sys.executable).with_name("mooncake_master"))
    binary = binary if Path(binary).exists() else shutil.which("mooncake_master")
    if binary is None:
        raise SystemExit("mooncake_master not found: install mooncake-transfer-engine-non-cuda")
    rpc, metrics = free_port(), free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen([binary, f"--rpc_port={rpc}", f"--metrics_port={metrics}"],
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", rpc), timeout=0.2).close()
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/health", timeout=0.5) as r:
                if r.status == 200:
                    return proc, f"127.0.0.1:{rpc}"
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"mooncake_master did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.01)


def clock(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def page_keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def exists_then_put(store: MooncakeStorage, io: DirectPageIO, keys: list[bytes], pages: list[int]) -> list[bool]:
    """The storage tier's backup (``StorageTier._write``) with its pre-check: ask which leading
    pages L3 already has, then put only the rest."""
    skip = store.batch_exists(keys)
    return [True] * skip + io.set_from(store, keys[skip:], pages[skip:])


def run_scenario(store: MooncakeStorage, page_size: int, n: int, repeats: int) -> dict[str, float]:
    geometry = KVGeometry(30, 3, 64, page_size, torch.float32)  # SmolLM2-135M
    host = HostKVPool(geometry, 3 * n, HostLayout.PAGE_FIRST_DIRECT)
    torch.nn.init.uniform_(host.buffer[:n])  # source pages; the others start zeroed
    store.register_buffer(host.buffer)
    _KEEP.append(host)  # registered with Mooncake until the client closes: never freed before
    raw = store._store  # the client inside our backend: same segment, same transfer engine
    io = DirectPageIO(host)  # how the storage tier hands page_first_direct pages to the backend
    pages = random.Random(page_size * 1000 + n).sample(range(3 * n), 3 * n)  # scattered, like a live pool
    src = [host.page_span(p) for p in pages[:n]]
    dst = [host.page_span(p) for p in pages[n : 2 * n]]  # ours reads into these, raw into its own
    raw_dst_ptrs = [host.page_span(p).data_ptr() for p in pages[2 * n :]]
    src_ptrs = [s.data_ptr() for s in src]
    sizes = [geometry.bytes_per_page] * n
    times: dict[str, list[float]] = {op: [] for op in OPS}
    total = repeats * min(4, -(-64 // n))  # small calls are noisier and cheap: repeat them more
    for rep in range(total + 1):
        keys = page_keys(f"ours/{page_size}/{n}/{rep}", n)
        names = [RAW_PREFIX + k.hex() for k in page_keys(f"raw/{page_size}/{n}/{rep}", n)]
        plain_keys = page_keys(f"plain/{page_size}/{n}/{rep}", n)  # fresh keys for each backup variant
        backup_keys = page_keys(f"backup/{page_size}/{n}/{rep}", n)
        ops = {
            "put_ours": partial(store.batch_set_from, keys, src),
            "put_raw": partial(raw.batch_put_from, names, src_ptrs, sizes),
            # the backup path without and with its pre-check, on new pages and then on the same
            # pages again (they exist by then)
            "plain_new": partial(io.set_from, store, plain_keys, pages[:n]),
            "backup_new": partial(exists_then_put, store, io, backup_keys, pages[:n]),
            "plain_existing": partial(io.set_from, store, plain_keys, pages[:n]),
            "backup_existing": partial(exists_then_put, store, io, backup_keys, pages[:n]),
            "exists": partial(raw.batch_is_exist, names),  # the pre-check's RPC alone
            "get_ours": partial(store.batch_get_into, keys, dst),
            "get_raw": partial(raw.batch_get_into, names, raw_dst_ptrs, sizes),
        }
        sequence = []
        for group in (["put_raw", "put_ours", "plain_new", "backup_new"], ["exists"],
                      ["plain_existing", "backup_existing"], ["get_raw", "get_ours"]):
            k = rep % len(group)  # rotate who goes first; every other cycle, reversed
            group = group[k:] + group[:k]
            sequence += group[::-1] if (rep // len(group)) % 2 else group
        sample: dict[str, float] = {}
        results: dict[str, object] = {}
        for op in sequence:
            sample[op], results[op] = clock(ops[op])
        for op in ("put_ours", "plain_new", "backup_new", "plain_existing", "backup_existing", "get_ours"):
            if results[op] != [True] * n:
                raise SystemExit(f"{op} failed: {results[op]}")
        if list(results["put_raw"]) != [0] * n or list(results["get_raw"]) != sizes:
            raise SystemExit(f"a raw call failed: put {results['put_raw']}, get {results['get_raw']}")
        # Content is checked once (the destinations start zeroed): zeroing them again before every
        # repetition would slow whichever put comes first (dirty cache lines), not the other.
        if not rep and not all(torch.equal(src[i], dst[i]) and torch.equal(src[i], host.buffer[pages[2 * n + i]])
                               for i in range(n)):
            raise SystemExit("a page read back differs from the page written")
        store.clear()  # force-removes (gets lease keys for 10 s) so the segment never fills
        raw.remove_by_regex("^" + RAW_PREFIX, True)
        if rep:  # the first repetition is a warm-up
            for name, t in sample.items():
                times[name].append(t)
        if rep % max(1, total // 4) == 0 or rep == total:
            print(f"  page size {page_size}, {n} pages/call, rep {rep}/{total}{' (warm-up)' if not rep else ''}: "
                  + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sample.items()), flush=True)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, a, b in (("d_put", "put_ours", "put_raw"), ("d_get", "get_ours", "get_raw"),
                       ("d_backup", "backup_new", "put_raw")):  # paired: each repetition's difference
        med[name] = statistics.median(x - y for x, y in zip(times[a], times[b], strict=True))
    for name, a, b in (("r_put", "put_ours", "put_raw"), ("r_get", "get_ours", "get_raw"),
                       ("r_backup", "backup_new", "put_raw"), ("r_new", "backup_new", "plain_new"),
                       ("r_existing", "backup_existing", "plain_existing")):
        med[name] = statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))
    med["reps"] = float(total)
    med["bytes"] = float(n * geometry.bytes_per_page)
    med.update(wrapper_costs(store, src, keys, n))
    return med


class _StubStore:
    """Answers at once with the codes of a successful call: what is left is our wrapper's cost."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def batch_put_from(self, names, ptrs, sizes):
        return [0] * len(names)

    def batch_get_into(self, names, ptrs, sizes):
        return list(self.sizes)


def wrapper_costs(store: MooncakeStorage, spans: list[torch.Tensor], keys: list[bytes], n: int,
                  loops: int = 200) -> dict[str, float]:
    """Seconds per call of each piece our backend adds around the raw call (best of 5 batches)."""

    def per_call(fn: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(loops):
                fn()
            best = min(best, (time.perf_counter() - start) / loops)
        return best

    out = {
        "w_names": per_call(lambda: store._names(keys)),
        "w_locate": per_call(lambda: store._locate(spans)),
    }
    real, store._store = store._store, _StubStore([s.numel() * s.element_size() for s in spans])
    hits, misses, writes = store.hits, store.misses, store.writes
    try:
        out["w_put"] = per_call(lambda: store.batch_set_from(keys, spans))
        out["w_get"] = per_call(lambda: store.batch_get_into(keys, spans))
    finally:
        store._store = real
        store.hits, store.misses, store.writes = hits, misses, writes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="+", default=["16:64", "64:16", "16:16", "16:4", "16:1"],
                    help="PAGE_SIZE:PAGES_PER_CALL, e.g. 16:64")
    ap.add_argument("--repeats", type=int, default=21, help="per scenario of >= 64 pages per call")
    args = ap.parse_args()
    scenarios = [tuple(int(x) for x in s.split(":")) for s in args.scenarios]
    largest = max(n * KVGeometry(30, 3, 64, p, torch.float32).bytes_per_page for p, n in scenarios)
    segment = 4 * largest + (64 << 20)  # ours, raw, plain and backup of one repetition, cleared after each
    with tempfile.TemporaryDirectory() as tmp:
        master, address = start_master(Path(tmp) / "mooncake_master.log")
        print(f"mooncake_master at {address}; one client, segment {segment >> 20} MiB", flush=True)
        try:
            store = MooncakeStorage(address, global_segment_size=segment, local_buffer_size=16 << 20,
                                    key_prefix=OURS_PREFIX)
            try:
                results = [(p, n, run_scenario(store, p, n, args.repeats)) for p, n in scenarios]
            finally:
                store.close()
        finally:
            master.kill()
            master.wait(timeout=10)
    print(f"\nMedians of {args.repeats} repeats (more for small calls, see above); overhead = ours / raw time - 1; "
          "exists + put = the backup path with its pre-check ((a) below) on new pages, against the raw put.\n")
    print("| page size | pages/call | MiB/call | put ours GB/s | put raw GB/s | put overhead "
          "| exists + put GB/s | exists + put overhead | get ours GB/s | get raw GB/s | get overhead |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p, n, m in results:
        gb = m["bytes"] / 1e9
        print(f"| {p} | {n} | {m['bytes'] / 2**20:.1f} | {gb / m['put_ours']:.2f} | {gb / m['put_raw']:.2f} "
              f"| {m['put_ours'] / m['put_raw'] - 1:+.1%} | {gb / m['backup_new']:.2f} "
              f"| {m['backup_new'] / m['put_raw'] - 1:+.1%} | {gb / m['get_ours']:.2f} | {gb / m['get_raw']:.2f} "
              f"| {m['get_ours'] / m['get_raw'] - 1:+.1%} |")
    print("\nWhat our backend adds per call, in µs: its pieces and whole wrappers timed against a stub store "
          "that answers at once (best of 5 x 200 calls); the paired median of ours minus raw in the run "
          "above; the raw calls; and the `batch_is_exist` RPC alone (the backup path's pre-check, (a) below):\n")
    print("| page size | pages/call | key names | span checks | put wrapper | get wrapper "
          "| put ours - raw, paired | get ours - raw, paired | raw put | raw get | exists RPC |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p, n, m in results:
        us = {k: v * 1e6 for k, v in m.items()}
        print(f"| {p} | {n} | {us['w_names']:.1f} | {us['w_locate']:.1f} | {us['w_put']:.1f} | {us['w_get']:.1f} "
              f"| {us['d_put']:+.0f} | {us['d_get']:+.0f} | {us['put_raw']:.0f} | {us['get_raw']:.0f} "
              f"| {us['exists']:.0f} |")
    print("\nThe backup path with and without its `batch_exists` pre-check, in µs (medians) and as the median of "
          "the per-repetition ratios (with / without): (a) exists, then a put of only the missing pages; "
          "(b) a put of all pages. New pages: none exists; existing: all do (a put of an existing key is a "
          "no-op in Mooncake). Break-even: the share of backups finding their pages in L3 above which the "
          "pre-check saves time on average, cost / (cost + saving).\n")
    print("| page size | pages/call | reps | new: (b) put | new: (a) exists + put | new: (a) / (b) "
          "| existing: (b) put | existing: (a) exists | existing: (a) / (b) | break-even |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p, n, m in results:
        us = {k: v * 1e6 for k, v in m.items()}
        cost, saving = m["backup_new"] - m["plain_new"], m["plain_existing"] - m["backup_existing"]
        even = f"{max(0.0, cost) / (max(0.0, cost) + saving):.2f}" if saving > 0 else "never"
        print(f"| {p} | {n} | {m['reps']:.0f} | {us['plain_new']:.0f} | {us['backup_new']:.0f} | {m['r_new']:.2f} "
              f"| {us['plain_existing']:.0f} | {us['backup_existing']:.0f} | {m['r_existing']:.2f} | {even} |")


if __name__ == "__main__":
    main()
