"""Item 2: reading L3 pages written at another TP size against reading them at the writer's.

Two ``tierserve serve`` writer nodes with HiCache and L3 on one real ``mooncake_master``, one at
TP=2 and one at TP=1, each compute a prompt of their own and back its pages up (their objects
then live in the writers' segments). This process then reads every full page of both prompts
with the L3 readers the prefetch path uses (``ShardIO.probe`` on the prefetch lane, then
``ShardIO.get_into`` 16 pages per call, as ``Prefetch.run`` does), through its own Mooncake
client (no segment of its own), into host pools shaped like a rank's:

- TP=2 pages: ``cross`` = a TP=1 reader (every page from two half-head objects, via a staging
  copy); ``same`` = the two ranks of a TP=2 reader (each its own object, zero-copy), one after the
  other;
- TP=1 pages: ``cross`` = the two ranks of a TP=2 reader (each reads the whole-page object into
  staging and keeps its half: twice the bytes on the wire), one after the other; ``same`` = a TP=1
  reader.

Both readers of a prompt end with the same bytes (every KV head of every page), so cross / same
per page-byte is the ratio of times, same / cross (target >= 0.7).

The writers are told the cluster's TP sizes (extra config ``l3_tp_sizes`` [1, 2]), so the TP=1
writer also stores every page in halves, which the TP=2 ranks read as their own objects; with
``plain`` they are not (one object per page and rank: the TP=2 ranks read whole pages and keep
half). The write rounds time what that costs the TP=1 writer: ``ShardIO.set_from`` of all the
pages under fresh keys, with and without the halves.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tp_common import PAGE, MasterProcess, ModelShape, ServeProcess, median, median_ratio, prompt, rotated

from tierserve.cache.device_pool import KVGeometry
from tierserve.cache.hashing import Namespace, page_keys
from tierserve.cache.host_pool import HostKVPool
from tierserve.cache.options import HostLayout, object_format
from tierserve.cache.prefetch import chunk_pages
from tierserve.cache.sharded.shard_io import ShardIO
from tierserve.cache.sharded.shards import HeadRange, KVShard, Source, object_key
from tierserve.cache.staging import page_io
from tierserve.cache.storage.mooncake import MooncakeStorage
from tierserve.model.identity import model_identity

LAYOUT = HostLayout.PAGE_FIRST_DIRECT  # the default host layout
BACKUP_DEADLINE_S = 120.0


@dataclass
class Reader:
    """One reader node: a ``ShardIO`` per rank over its own host pool, and the source each rank's
    probe picked for the prompt being read."""

    ranks: list[ShardIO]
    sources: list[Source]


CLUSTER_TP_SIZES = [1, 2]  # what the writers are told unless plain


def writer_flags(master: MasterProcess, prompt_tokens: int, plain: bool) -> list[str]:
    l3 = {"master_server_address": master.address, "global_segment_size": 256 << 20, "local_buffer_size": 32 << 20,
          "l3_tp_sizes": [] if plain else CLUSTER_TP_SIZES}
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
            "--hicache-storage-backend-extra-config", json.dumps(l3), "--max-total-tokens", "8192",
            "--chunked-prefill-size", str(max(prompt_tokens, 512))]


def keys_of(model: Path, shape: ModelShape, tokens: list[int]) -> list[bytes]:
    """The page keys every node of this model computes for ``tokens``' full pages, at any TP size."""
    seed = Namespace(model_identity(model), "float32", PAGE, shape.layers, shape.kv_heads, shape.head_dim,
                     object_format(LAYOUT)).seed()
    return page_keys(seed, tokens[: len(tokens) // PAGE * PAGE], PAGE)


def wait_stored(store: MooncakeStorage, names: list[bytes]) -> None:
    deadline = time.monotonic() + BACKUP_DEADLINE_S
    while store.batch_exists(names) < len(names):
        if time.monotonic() > deadline:
            raise RuntimeError(f"backups not in L3 after {BACKUP_DEADLINE_S} s")
        time.sleep(0.1)  # poll interval


def write_prompt(model: Path, shape: ModelShape, master: MasterProcess, store: MooncakeStorage, tp: int,
                 tokens: list[int], log: Path, plain: bool) -> list[bytes]:
    """A ``tp``-rank node computes ``tokens`` and backs its pages up; returns their page keys."""
    import httpx

    node = ServeProcess(model, tp, log, *writer_flags(master, len(tokens), plain))
    _NODES.append(node)  # stays up to the end: its segment holds the objects
    node.wait_healthy()
    body = {"model": model.name, "prompt": tokens, "max_tokens": 1, "temperature": 0}
    httpx.post(f"{node.url}/v1/completions", json=body, timeout=600).raise_for_status()
    keys = keys_of(model, shape, tokens)
    told = [tp] if plain else [t for t in CLUSTER_TP_SIZES if t >= tp]  # its own share, then the finer ones
    counts = {shape.kv_heads // t for t in told}
    wait_stored(store, [object_key(k, HeadRange(h, c, shape.kv_heads))
                        for c in counts for k in keys for h in range(0, shape.kv_heads, c)])
    return keys


_NODES: list[ServeProcess] = []


def reader(store: MooncakeStorage, shape: ModelShape, tp: int, pages: int) -> Reader:
    ranks = []
    for r in range(tp):
        count = shape.kv_heads // tp
        host = HostKVPool(KVGeometry(shape.layers, count, shape.head_dim, PAGE, torch.float32), pages, LAYOUT)
        io = ShardIO(host, page_io(host), KVShard(HeadRange(r * count, count, shape.kv_heads), r, True, tp))
        store.attach_host_buffer(io.buffer)
        ranks.append(io)
    return Reader(ranks, [])


def probe(store: MooncakeStorage, node: Reader, keys: list[bytes]) -> float:
    """Every rank's probe, one after the other (seconds); keeps each rank's source."""
    start = time.perf_counter()
    found = [io.probe(store, keys) for io in node.ranks]
    elapsed = time.perf_counter() - start
    if any(n != len(keys) for n, _ in found):
        raise RuntimeError(f"L3 probe found {[n for n, _ in found]} of {len(keys)} pages")
    node.sources = [source for _, source in found]
    return elapsed


def read(store: MooncakeStorage, node: Reader, keys: list[bytes]) -> float:
    """Every rank reads its heads of every page, as many per call as the prefetcher's (``chunk_pages``),
    one rank after the other."""
    start = time.perf_counter()
    for io, source in zip(node.ranks, node.sources, strict=True):
        per_call = chunk_pages(io.host.geometry.bytes_per_page)
        for at in range(0, len(keys), per_call):
            chunk = keys[at : at + per_call]
            if not all(io.get_into(store, source, chunk, list(range(at, at + len(chunk))))):
                raise RuntimeError("an L3 read failed")
    return time.perf_counter() - start


def write(store: MooncakeStorage, io: ShardIO, keys: list[bytes]) -> float:
    """One backup of every host page of ``io`` under ``keys`` (new names), as ``StorageTier`` does it."""
    start = time.perf_counter()
    if not all(io.set_from(store, keys, list(range(len(keys))))):
        raise RuntimeError("an L3 write failed")
    return time.perf_counter() - start


def whole_pages(node: Reader) -> torch.Tensor:
    """The reader's host pages with every rank's heads side by side: [pages, L, 2, page, heads, dim]."""
    views = [io.host.run_all_layers(0, io.host.num_pages) for io in node.ranks]
    return torch.cat([v.movedim(2, 0) for v in views], dim=-2)


@dataclass(frozen=True)
class L3Args:
    prompt_tokens: int
    repeats: int
    write_repeats: int  # rounds that also time writes (each stores 3 pages' worth per page: segments are finite)
    plain: bool


def measure(model: Path, shape: ModelShape, logs: Path, args: L3Args
            ) -> tuple[list[dict[str, float]], dict[str, float]]:
    master = MasterProcess(logs / "mooncake_master.log").start()
    store = None
    try:
        store = MooncakeStorage(master.address, global_segment_size=0, local_buffer_size=32 << 20)
        written = {tp: write_prompt(model, shape, master, store, tp, prompt(args.prompt_tokens, 900 + tp), logs /
                                    f"l3-writer-tp{tp}.log", args.plain) for tp in (2, 1)}
        pages = len(written[1])
        readers = {tp: reader(store, shape, tp, pages) for tp in (1, 2)}
        plain_io = readers[1].ranks[0]  # holds the TP=1 prompt's pages once read: the TP=1 writer's
        writers = {"write_whole": plain_io, "write_with_halves": ShardIO(
            plain_io.host, plain_io.io, dataclasses.replace(plain_io.shard, finer=(shape.kv_heads // 2,)))}
        cases = {"from_tp2_cross": (readers[1], written[2]), "from_tp2_same": (readers[2], written[2]),
                 "from_tp1_cross": (readers[2], written[1]), "from_tp1_same": (readers[1], written[1])}
        rounds = []
        for turn in range(args.repeats + 1):
            sample: dict[str, float] = {}
            for name in rotated(list(cases), turn):
                node, keys = cases[name]
                sample[f"probe_{name}"] = probe(store, node, keys)
                sample[name] = read(store, node, keys)
            for name in rotated(list(writers), turn) if turn <= args.write_repeats else []:
                fresh = page_keys(f"{name}-{turn}".encode(), list(range(pages * PAGE)), PAGE)
                sample[name] = write(store, writers[name], fresh)
            if turn == 0:
                _check_same_bytes(store, readers, written)
            print(f"  L3 {'warm-up' if not turn else f'round {turn}'} (ms): "
                  + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sample.items()), flush=True)
            if turn:
                rounds.append(sample)
        facts = {"pages": float(pages), "bytes": float(pages * PAGE * shape.token_bytes)}
        return rounds, facts
    finally:
        for node in _NODES:
            node.stop()
        _NODES.clear()
        if store is not None:
            store.close()
        master.kill()


def _check_same_bytes(store: MooncakeStorage, readers: dict[int, Reader], written: dict[int, list[bytes]]) -> None:
    """The TP=1 and TP=2 readers of one prompt hold the same KV (read again, untimed)."""
    for keys in written.values():
        for node in readers.values():
            probe(store, node, keys)
            read(store, node, keys)
        if not torch.equal(whole_pages(readers[1]), whole_pages(readers[2])):
            raise RuntimeError("the TP=1 and TP=2 readers read different KV for the same pages")


def report(rounds: list[dict[str, float]], facts: dict[str, float]) -> list[str]:
    mib = facts["bytes"] / 2**20
    gb = facts["bytes"] / 1e9
    rows = ["| pages written by | reader | read (ms) | GB/s | probe (ms) |", "|---|---|---:|---:|---:|"]
    for writer, cross, same in (("TP=2", "TP=1", "TP=2"), ("TP=1", "TP=2", "TP=1")):
        w = writer[-1]
        for kind, who in (("cross", cross), ("same", same)):
            key = f"from_tp{w}_{kind}"
            rows.append(f"| {writer} | {who} ({kind}) | {median(rounds, key) * 1e3:.1f} "
                        f"| {gb / median(rounds, key):.2f} | {median(rounds, 'probe_' + key) * 1e3:.2f} |")
    ratios = [f"| **cross / same per page-byte, TP=2 pages** (TP=1 reader vs TP=2 reader) "
              f"| **{median_ratio(rounds, 'from_tp2_same', 'from_tp2_cross'):.2f}** |",
              f"| **cross / same per page-byte, TP=1 pages** (TP=2 reader vs TP=1 reader) "
              f"| **{median_ratio(rounds, 'from_tp1_same', 'from_tp1_cross'):.2f}** |"]
    timed = [r for r in rounds if "write_whole" in r]
    if timed:
        ms = f"{median(timed, 'write_with_halves') * 1e3:.1f} / {median(timed, 'write_whole') * 1e3:.1f}"
        ratios.append(f"| TP=1 writer, write time with halves / whole only (ms: {ms}; {len(timed)} rounds) "
                      f"| {median_ratio(timed, 'write_with_halves', 'write_whole'):.2f} |")
    return [f"{facts['pages']:.0f} pages of {PAGE} tokens per prompt ({mib:.1f} MiB of KV); medians of "
            f"{len(rounds)} rounds; ratios: medians of the per-round ratios of read times", "", *rows, "",
            "| ratio | value |", "|---|---:|", *ratios]
