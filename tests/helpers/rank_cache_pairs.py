"""Two ranks' HiCaches in one process, driven in lock-step (``test_rank_cache_machine``): the real
cache code of a CP=2 or a TP=2 node's ranks over one shared L3, with fakes only for time and for the
other process. Each rank's copies run on executors the test steps by hand (so one rank's copies can
finish later than the other's); the agreement is a real minimum over both ranks' values, taken by
two threads that meet at a barrier (as two processes meet in ``CollectiveMin``), with a deadline so
that ranks running different collectives fail the test instead of hanging it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import torch

from helpers.hicache_fakes import PS, FaultyLoader, MemoryStorage, StepExecutor
from tierserve.cache.allocator import PageAllocator
from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.hicache import HiCache, HiCacheConfig
from tierserve.cache.host_pool import HostKVPool, HostLayout
from tierserve.cache.options import PrefetchPolicy
from tierserve.cache.prefetch import PrefetchOptions
from tierserve.cache.radix_tree import Node, path_to_root
from tierserve.cache.sharded.cp_pages import PageOwnership, ShardedPageAllocator
from tierserve.cache.sharded.shards import HeadRange, KVShard
from tierserve.cache.storage import StorageBackend

T = TypeVar("T")
RANKS = 2
HEADS = 2  # KV heads of the model: a TP rank holds one, a CP rank both
DEVICE_PAGES, HOST_PAGES = 12, 24  # a node's logical pages (a CP rank's pools hold half)
PAIR_SEED = b"p" * 32
PAIR_OPTIONS = PrefetchOptions(threshold_tokens=PS, max_reserved_fraction=0.5)
MEET_S = 10.0  # how long a rank waits at the barrier for the other's collective


class Layout(Enum):
    CP = "cp"
    TP = "tp"


class PairAgreement:
    """The element-wise minimum over two ranks that call ``min`` from two threads (``rank(r)`` is
    rank r's ``Agreement``)."""

    def __init__(self) -> None:
        self._barrier = threading.Barrier(RANKS, timeout=MEET_S)
        self._values: list[list[int]] = [[] for _ in range(RANKS)]

    def rank(self, rank: int) -> RankAgreement:
        return RankAgreement(self, rank)

    def min(self, rank: int, values: list[int]) -> list[int]:
        self._values[rank] = list(values)
        self._barrier.wait()  # both ranks' values are in
        agreed = [min(column) for column in zip(*self._values, strict=True)]
        self._barrier.wait()  # both read them before either calls again
        return agreed


@dataclass(frozen=True)
class RankAgreement:
    pair: PairAgreement
    rank: int

    def min(self, values: list[int]) -> list[int]:
        return self.pair.min(self.rank, values)


class RankStore(StorageBackend):
    """One rank's client of the node's shared L3 (``shared``). ``short_read``: the rank's next read
    call gets only its first that many objects (the rest fail, as a lost or unreadable object
    does), on this rank only."""

    put_skips_existing = True

    def __init__(self, shared: MemoryStorage) -> None:
        self.shared = shared
        self.short_read: int | None = None

    def batch_exists(self, keys: list[bytes]) -> int:
        return self.shared.batch_exists(keys)

    def batch_get_into(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        n, self.short_read = (len(keys) if self.short_read is None else self.short_read), None
        return self.shared.batch_get_into(keys[:n], spans[:n]) + [False] * (len(keys) - min(n, len(keys)))

    def batch_set_from(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        return self.shared.batch_set_from(keys, spans)

    def get(self, key: bytes) -> bytes | None:
        return self.shared.get(key)

    def set(self, key: bytes, data: bytes) -> bool:
        raise NotImplementedError

    def clear(self) -> None:
        self.shared.clear()

    def stats(self) -> dict[str, Any]:
        return self.shared.stats()


class FailingWrites:
    """The cache's L1 -> L2 writer; after ``armed`` the next write submitted fails (a host copy
    error) on this rank only."""

    def __init__(self, inner: StepExecutor) -> None:
        self.inner, self.armed = inner, False

    def submit(self, fn, *args) -> Future:
        if not self.armed:
            return self.inner.submit(fn, *args)
        self.armed = False
        return self.inner.submit(_fail_write)

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait)


def _fail_write() -> float:
    raise RuntimeError("host memory write failed (test fault)")


@dataclass
class RankCache:
    """One rank: its cache, its device allocator, the executors of its L1 <-> L2 copies (``io``)
    and L3 calls (``l3``), its fault switches and its L3 client."""

    cache: HiCache
    alloc: PageAllocator | ShardedPageAllocator
    io: StepExecutor
    l3: StepExecutor
    loader: FaultyLoader
    writer: FailingWrites
    store: RankStore


def rank_cache(layout: Layout, rank: int, agreement: RankAgreement, shared: MemoryStorage) -> RankCache:
    """Rank ``rank`` of a ``layout`` = 2 node, built as ``build_cache`` builds it (its pools, page
    ownership or heads, the agreement), its background work on executors the test steps."""
    cp = layout is Layout.CP
    own = PageOwnership(rank, RANKS) if cp else PageOwnership()
    geometry = KVGeometry(2, HEADS if cp else HEADS // RANKS, 2, PS, torch.float32)
    device_pages, host_pages = (DEVICE_PAGES // RANKS, HOST_PAGES // RANKS) if cp else (DEVICE_PAGES, HOST_PAGES)
    alloc = ShardedPageAllocator(own, device_pages) if cp else PageAllocator(device_pages)
    shard = KVShard.whole(HEADS) if cp else KVShard(HeadRange(rank, 1, HEADS), rank=rank, ranks=RANKS)
    store = RankStore(shared)
    config = HiCacheConfig(prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, prefetch=PAIR_OPTIONS)
    cache = HiCache(alloc, DeviceKVPool(geometry, device_pages, torch.device("cpu")),
                    HostKVPool(geometry, host_pages, HostLayout.PAGE_FIRST_DIRECT, ownership=own), PAIR_SEED, config,
                    store, agreement, shard, own)
    io, l3 = StepExecutor(), StepExecutor()
    for executor in (cache._worker, cache._loader, cache.storage._worker, cache.storage._reader):
        executor.shutdown()
    writer, loader = FailingWrites(io), FaultyLoader(io)  # one queue, as one copy engine
    cache._worker, cache._loader = writer, loader
    cache.storage._worker = cache.storage._reader = l3
    return RankCache(cache, alloc, io, l3, loader, writer, store)


class RankPair:
    """A node's two ranks; ``both(fn)`` runs ``fn(rank)`` on each, in two threads (what may meet
    in a collective must run side by side), and returns both results."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.store = MemoryStorage()
        agreement = PairAgreement()
        self.ranks = [rank_cache(layout, r, agreement.rank(r), self.store) for r in range(RANKS)]
        self._threads = ThreadPoolExecutor(max_workers=RANKS, thread_name_prefix="rank")

    def both(self, fn: Callable[[RankCache], T]) -> list[T]:
        futures = [self._threads.submit(fn, rank) for rank in self.ranks]
        return [f.result(timeout=2 * MEET_S) for f in futures]

    def each(self, fn: Callable[[RankCache], T]) -> list[T]:
        """``fn`` on each rank in turn, in this thread: for calls that run no collective."""
        return [fn(rank) for rank in self.ranks]

    def close(self) -> None:
        self.each(lambda r: r.cache.close())
        self._threads.shutdown()


def tree_view(cache: HiCache) -> list[tuple]:
    """A rank's tree as every rank must hold it: each node's salt and token path, logical device
    and host pages, and whether it is loading or writing."""
    out = []
    for salt, root in cache.tree.roots.items():
        stack: list[tuple[Node, tuple[int, ...]]] = [(c, ()) for c in root.children.values()]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.tokens
            out.append((salt, path, node.device, node.host, node.loading is not None, node.writing))
            stack += [(c, path) for c in node.children.values()]
    return sorted(out, key=lambda entry: (entry[0], entry[1]))


def rotation_breaks(cache: HiCache) -> list[str]:
    """Where ``cache``'s tree is not one rotation per path (``docs/cp.md``): a node whose device and
    host copies have other owners, or a path whose owners do not follow ``(start + j) % size``."""
    own = cache.ownership
    breaks = []
    for node in cache.tree.nodes():
        if node.device is not None and node.host is not None:
            device, host = [own.owner(p) for p in node.device], [own.owner(p) for p in node.host]
            if device != host:
                breaks.append(f"node {node.tokens}: L1 owners {device} and L2 owners {host} differ")
        owners = [own.owner(p) for n in reversed(list(path_to_root(node))) for p in (n.device or n.host or [])]
        if owners != [(owners[0] + j) % own.size for j in range(len(owners))]:
            breaks.append(f"the path to {node.tokens} is owned {owners}")
    return breaks
