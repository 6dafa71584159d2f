"""HiCache over L1 (device pool), L2 (host pool) and L3 (a storage backend) under one radix tree.

Writes L1 -> L2 run on a worker thread and are applied to the tree at the next step boundary
(``on_step``). Loads L2 -> L1 are on a request's critical path, so they have a worker of their
own (never queued behind writes) and copy layer by layer: a request's attention in layer i only
waits for layer i while later layers are still copying.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tierserve.cache import generated, inflight
from tierserve.cache.allocator import PageAllocator
from tierserve.cache.base import PrefixHit, Snapshot
from tierserve.cache.device_pool import DeviceKVPool
from tierserve.cache.draft_kv import SidecarKV, load_layers, planes
from tierserve.cache.events import KVEventListener
from tierserve.cache.host_pool import HostKVPool, copy_pages
from tierserve.cache.host_writes import WRITE_BACK_LOW_WATERMARK, assign_host, dirty_lru, end_failed_write
from tierserve.cache.l3_slot import L3Slot
from tierserve.cache.lanes import Lane, close_lanes
from tierserve.cache.loads import LayerwiseLoad, Loads
from tierserve.cache.options import IOBackend, PrefetchPolicy, WritePolicy
from tierserve.cache.prefetch import PrefetchOptions, PrefetchTicket
from tierserve.cache.radix_cache import cp_storable
from tierserve.cache.radix_tree import Match, Node, RadixTree, path_pages, path_to_root
from tierserve.cache.sharded.agreement import Agreement, SingleRank, leading_true
from tierserve.cache.sharded.cp_host import owned_pairs, rank_host_stats
from tierserve.cache.sharded.cp_pages import PageOwnership, alloc_continuing, alloc_like, until_fits
from tierserve.cache.sharded.shards import KVShard
from tierserve.cache.storage import StorageBackend
from tierserve.cache.storage_tier import StorageTier
from tierserve.core.scope import NO_SCOPE, CacheScope
from tierserve.core.storage import StorageAction
from tierserve.core.tiers import CacheTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HiCacheConfig:
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    io_backend: IOBackend = IOBackend.KERNEL
    write_threshold: int = 2
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.AUTO
    prefetch: PrefetchOptions = field(default_factory=PrefetchOptions)


@dataclass
class _Write:
    node: Node
    host_pages: list[int]
    future: Future
    keys: list[bytes]


class HiCache:
    """The engine's prefix cache over L1, L2 and L3 (the ``cache.base.PrefixCache`` contract); L3
    sits in a slot (``l3``) that the admin calls fill and empty at run time.

    Page ownership: device pages belong to the device allocator's free list, a request, or the
    tree; host pages to the host pool's allocator or the tree (or an in-flight write). After an
    L2 -> L1 load fails (``HostLoadError`` from ``wait``), its device pages leave the tree and belong
    to ``loads`` until the requests holding them are released; those requests must not go on.

    ``ownership``: a CP rank's. Device and host page ids are then logical, each page stored by its
    owner rank only, and every copy between tiers moves a page within its owner (``cp_host``).
    """

    def __init__(self, allocator: PageAllocator, device: DeviceKVPool, host: HostKVPool, seed: bytes,
                 config: HiCacheConfig, storage: StorageBackend | None = None,
                 agreement: Agreement | None = None, shard: KVShard | None = None,
                 ownership: PageOwnership | None = None, sidecar: SidecarKV | None = None) -> None:
        """``shard``: the heads of every page this rank holds (default: all of the host pool's, one
        rank); ``agreement``: how the ranks agree on what finished (default: one rank);
        ``ownership``: which pages this CP rank stores (default: all, no CP); ``sidecar``: a
        speculative draft's pools, copied with the target's pages (``cache/draft_kv.py``)."""
        self.allocator, self.device, self.host, self.config = allocator, device, host, config
        self.sidecar = sidecar
        self.ownership = ownership or PageOwnership()
        self.shard = shard or KVShard.whole(host.geometry.num_kv_heads)
        self.page_size = device.page_size
        self.tree = RadixTree(self.page_size, seed)
        self._worker = Lane("hicache-write")
        self._loader = Lane("hicache-load")
        self._writes: list[_Write] = []
        self.loads = Loads(self.tree, allocator)
        self.counters: Counter[str] = Counter()  # engine thread only
        for name in ("cp_refused_pages_total", "offload_checkpoint_pages_total", "offload_deferred_pages_total",
                     "inflight_shared_pages_total", "device_evicted_pages_total", "host_evicted_pages_total"):
            self.counters[name] += 0  # always published
        self.agreement = agreement or SingleRank()
        self.l3 = L3Slot(self._storage_tier, lambda: self.busy)
        if storage is not None:
            self.l3.attach(storage)

    def _storage_tier(self, storage: StorageBackend) -> StorageTier:
        """An L3 tier over ``storage`` behind this cache's host pool and tree (``l3``'s ``make``)."""
        return StorageTier(storage, self.host, self.tree, self.config.prefetch, self._host_pages_after,
                           self.shard, self.ownership, self.sidecar)

    @property
    def storage(self) -> StorageTier | None:
        """The attached L3 tier (None: no L3)."""
        return self.l3.tier

    @property
    def num_cached_pages(self) -> int:
        """Unpinned L1 pages (what a running request or a copy pins counts as used)."""
        return self.tree.num_device_pages - self.tree.num_pinned_device_pages

    def close(self) -> None:
        """Stops the L2 lanes (waiting a bounded time, ``close_lanes``), then the L3 tier."""
        close_lanes((self._worker, self._loader), "L2")
        self.l3.close()

    def flush(self, device: bool, host: bool) -> tuple[int, int]:
        """Drops unpinned L1 and/or L2 pages, after the copies in flight landed, those the flush
        starts included. At several ranks every rank calls it at the same point (an engine call
        rank 0 sends with the steps)."""
        host_before = self.host.allocator.num_used
        device_pages = self._flush_device() if device else 0  # may drop host copies too
        self.wait_background()  # copies in flight pin their pages
        if host:
            self.host.allocator.free(self.tree.evict_host(self.host.allocator.num_pages))
        return device_pages, host_before - self.host.allocator.num_used

    def _flush_device(self) -> int:
        """Evicts L1 until no unpinned page is left. Write-back with L3 backs a dirty victim up,
        which pins its path until the backup lands: its parents stay in L1 (and it in L2) until
        then, so each round waits for the copies in flight (agreed, the same rounds on every rank)."""
        self.wait_background()
        total = freed = self.evict(self.allocator.num_pages)
        while freed and self.copies_in_flight:
            self.wait_background()
            freed = self.evict(self.allocator.num_pages)
            total += freed
        return total

    def set_event_listener(self, listener: KVEventListener) -> bool:
        self.tree.listener = listener
        return True

    def set_waker(self, wake: Callable[[], None]) -> None:
        self.l3.set_waker(wake)

    def storage_admin(self, action: StorageAction, backend: StorageBackend | None = None) -> dict[str, Any]:
        return self.l3.admin(action, backend)

    def snapshot(self) -> Snapshot:
        return self.tree.snapshot()

    @property
    def busy(self) -> bool:
        """Background copies (L1 -> L2 writes, L3 backups or prefetches) are in flight. They are
        applied only at steps, so an engine with nothing else to do keeps stepping meanwhile."""
        return bool(self._writes) or (self.storage is not None and self.storage.busy)

    @property
    def awaits_peers(self) -> bool:
        return self.storage is not None and self.storage.awaits_peers

    # -- the engine hook -------------------------------------------------------------------------

    def prefetch(self, token_ids: Sequence[int], scope: CacheScope = NO_SCOPE,
                 l3_pending: int = 0) -> PrefetchTicket | None:
        return self.storage.start(token_ids, scope.salt, l3_pending) if self.storage is not None else None

    def ready(self, ticket: PrefetchTicket | None) -> bool:
        if ticket is None or self.storage is None:
            return True
        return self.storage.ready(ticket, self.config.prefetch_policy)

    def record_compute(self, num_tokens: int, seconds: float) -> None:
        if self.storage is not None:
            self.storage.speed.record_prefill(num_tokens, seconds)

    def cancel(self, ticket: PrefetchTicket | None) -> None:
        if ticket is not None and self.storage is not None:
            self.storage.drop(ticket)

    def match(self, token_ids: Sequence[int], ticket: PrefetchTicket | None = None,
              scope: CacheScope = NO_SCOPE) -> PrefixHit:
        """The longest prefix in L1 or L2 (after applying a finished prefetch), pinned; its L2 part
        starts loading into L1 layer by layer (when L1 has no room, only the L1 part is used)."""
        salt = scope.salt
        self._finish_prefetch(ticket, token_ids, salt)
        found = self.tree.match(token_ids, salt)
        # ``loading`` is cleared only once every rank agreed the load done: the same list on every rank
        pending = [n.loading for n in path_to_root(found.device_node) if n.loading is not None]
        node, load = self._pin_and_load(found)
        self.write_path(node)
        pages = path_pages(node)
        loads = pending + ([load] if load is not None else [])
        hit = PrefixHit(len(pages) * self.page_size, pages, self._tiers(found, load, len(pages)), handle=node,
                        loads=loads, salt=salt)
        self.loads.lent(hit)
        return hit

    def _finish_prefetch(self, ticket: PrefetchTicket | None, token_ids: Sequence[int], salt: str) -> None:
        """Inserts what the request's L3 prefetch brought into L2 as host-only nodes."""
        if ticket is not None and self.storage is not None:
            self.storage.finish(ticket, token_ids, salt)

    def _pin_and_load(self, found: Match) -> tuple[Node, LayerwiseLoad | None]:
        """Pins the whole match first (so making room in L1 cannot evict it), then starts loading
        its L2 part; without room, unpins down to the L1 part. Returns the pinned node and the load."""
        self.tree.lock(found.last_node)
        if not found.host_pages:
            return found.last_node, None
        load = self._load(found.host_nodes, found.host_pages)
        if load is None:
            self.tree.unlock(found.last_node)
            self.tree.lock(found.device_node)
            return found.device_node, None
        return found.last_node, load

    def _tiers(self, found: Match, load: LayerwiseLoad | None, num_pages: int) -> dict[CacheTier, int]:
        """The hit's tokens by the tier they came from; pages L3 brought count as storage once."""
        host = storage = 0
        if load is not None:
            host = len(found.host_pages)
            storage = sum(n.num_pages for n in found.host_nodes if n.from_storage)
            for n in found.host_nodes:
                n.from_storage = False
        pages = {CacheTier.DEVICE: num_pages - host, CacheTier.HOST: host - storage, CacheTier.STORAGE: storage}
        return {tier: n * self.page_size for tier, n in pages.items() if n}

    def release(self, token_ids: Sequence[int], pages: list[int], num_computed: int, hit: PrefixHit) -> None:
        """Only KV before the first page of a failed load goes into the tree: the rest is garbage
        (that page's load) or was computed from it; pages the failed load owns are not freed here."""
        self.loads.returned(hit)
        full = min(num_computed // self.page_size, len(pages), self.loads.usable(pages))
        full = self._storable(token_ids, pages[:full], hit.salt)
        unused, node = self.tree.insert(token_ids[: full * self.page_size], pages[:full], hit.salt)
        self.allocator.free(unused + [p for p in pages[full:] if not self.loads.is_orphan(p)])
        self.loads.collect()
        if hit.handle is not None:
            self.tree.unlock(hit.handle)
        if self.config.write_policy is WritePolicy.WRITE_THROUGH:
            self.write_path(node)

    def checkpoint(self, token_ids: Sequence[int], pages: list[int], num_computed: int,
                   hit: PrefixHit) -> PrefixHit | None:
        """Continuous offload (``cache/generated.py``): the hit's new full pages join the tree and
        its path is copied to L2 whatever the write policy, unless the copy queue is full. Under CP
        only the pages that keep the path one rotation join (as at release, uncounted: a later
        checkpoint or the release counts what is refused); each owner copies its own."""
        storable = partial(cp_storable, self.tree, self.ownership) if self.ownership.size > 1 else None
        lent = generated.checkpoint(self.tree, self.loads, self.allocator, token_ids, pages, num_computed, hit,
                                    storable)
        if lent is not None:
            self._offload(lent.handle, lent.num_tokens // self.page_size - len(hit.pages))
        return lent

    shares_in_flight = True

    def share(self, token_ids: Sequence[int], pages: list[int], num_full: int, hit: PrefixHit) -> PrefixHit | None:
        """In-flight sharing (``cache/inflight.py``); the new path is copied to L2 as the write policy
        says of a release (``write_through``: now)."""
        num_full = min(num_full, self.loads.usable(pages))
        num_full = cp_storable(self.tree, self.ownership, token_ids, pages[:num_full], hit.salt)
        lent = inflight.share(self.tree, token_ids, pages, num_full, hit, self.loads)
        if lent is None:
            return None
        self.counters["inflight_shared_pages_total"] += len(lent.pages) - len(hit.pages)
        if self.config.write_policy is WritePolicy.WRITE_THROUGH:
            self.write_path(lent.handle)
        return lent

    def cached_prefix(self, token_ids: Sequence[int], scope: CacheScope = NO_SCOPE) -> int:
        return self.tree.cached_pages(token_ids, scope.salt)

    def _offload(self, node: Node, new_pages: int) -> None:
        """A checkpoint's copies to L2: every node on ``node``'s path still without one, whatever
        the write policy (the point is that the pages outlive this node), unless the copy queue is
        full (``generated.copy_now``: the pages wait in L1 for the next checkpoint or the release)."""
        if not generated.copy_now(self.copies_in_flight):
            self.counters["offload_deferred_pages_total"] += new_pages
            return
        self.counters["offload_checkpoint_pages_total"] += new_pages
        self.write_path(node, every=True)

    def _storable(self, token_ids: Sequence[int], pages: list[int], salt: str) -> int:
        """How many of ``pages`` the tree may take (under CP, not a second rotation: counted)."""
        keep = cp_storable(self.tree, self.ownership, token_ids, pages, salt)
        self.counters["cp_refused_pages_total"] += len(pages) - keep
        return keep

    def evict(self, num_pages: int) -> int:
        backup = self._write_now if self.config.write_policy is WritePolicy.WRITE_BACK else None
        device, host = self.tree.evict_device(num_pages, backup)
        self.allocator.free(device)
        self.host.allocator.free(host)
        self.counters["device_evicted_pages_total"] += len(device)
        self.counters["host_evicted_pages_total"] += len(host)
        return len(device)

    def stats(self) -> dict[str, float]:
        """Every counter, the host pool's occupancy (whole and this rank's own share), bytes copied
        and, with L3, its tier's counters."""
        page = self.device.geometry.bytes_per_page
        out: dict[str, float] = dict(self.counters)
        out["host_pages_used"] = self.host.allocator.num_used
        out["host_pages_total"] = self.host.allocator.num_pages
        out |= rank_host_stats(self.host, self.ownership)
        out["l2_write_bytes_total"] = self.counters["l2_write_pages_total"] * page
        out["l2_load_bytes_total"] = self.counters["l2_load_pages_total"] * page
        out["l2_load_failures_total"] = self.loads.failures
        return out | _l3_bytes(self.l3.stats(), page)

    def on_step(self) -> None:
        """Agrees with the other ranks (one collective) on what finished, then applies it."""
        local = [leading_true(w.future.done() for w in self._writes),
                 leading_true(w.future.done() and w.future.exception() is None for w in self._writes),
                 *self.loads.local_state()]
        if self.storage is not None:
            local += self.storage.local_state()
        agreed = self.agreement.min(local)
        self._apply_writes(*agreed[:2])
        self._write_back_ahead()
        self.loads.apply(*agreed[2:4])
        self.loads.collect()
        if self.storage is not None:
            self.storage.apply(agreed[4:])

    def wait_background(self, timeout: float = 30.0) -> None:
        """Waits for in-flight L2 writes (and the write-backs their landing starts) and the L3
        backups they lead to, and applies them. For tests, benchmarks, flush and shutdown; at
        several ranks every rank must call it at the same point: it loops on agreed values only
        (the writes left and whether every rank is still in time), so all run as many collectives."""
        deadline = time.monotonic() + timeout
        while self._writes and self.agreement.min([int(time.monotonic() < deadline)])[0]:
            futures.wait([w.future for w in self._writes], timeout=deadline - time.monotonic())
            self.on_step()
        if self.storage is not None:
            self.storage.wait_backups(max(0.0, deadline - time.monotonic()))
        self.on_step()  # also lets loads that landed become evictable

    def _apply_writes(self, done: int, ok: int) -> None:
        """The first ``done`` writes finished on every rank, the first ``ok`` of them well."""
        for i, write in enumerate(self._writes[:done]):
            if i >= ok:
                end_failed_write(write.node, len(write.host_pages))
                log.warning("L1 -> L2 copy failed (on this or another rank): %s", write.future.exception())
                self.host.allocator.free(write.host_pages)
                self.tree.unlock(write.node)
                continue
            assign_host(self.tree, write.node, write.host_pages)
            self.counters["l2_write_pages_total"] += len(write.host_pages)
            self.counters["l2_write_seconds_total"] += write.future.result()
            if self.storage is not None:  # back the pages up to L3; the node stays pinned meanwhile
                self.storage.backup(write.node, write.keys, write.host_pages)
            else:
                self.tree.unlock(write.node)
        self._writes = self._writes[done:]

    # -- L1 -> L2 ------------------------------------------------------------------------------

    @property
    def copies_in_flight(self) -> int:
        """L1 -> L2 writes and L3 backups not yet applied (the same count on every rank)."""
        return len(self._writes) + (self.storage.backups_in_flight if self.storage is not None else 0)

    def write_path(self, node: Node, every: bool = False) -> None:
        """Copies to L2 the nodes on ``node``'s path that the write policy says should be there
        (``every``: all of them, whatever the policy: continuous offload)."""
        policy = self.config.write_policy
        if policy is WritePolicy.WRITE_BACK and not every:
            return
        for n in path_to_root(node):
            wanted = every or policy is WritePolicy.WRITE_THROUGH or n.hits >= self.config.write_threshold
            if wanted and n.host is None and n.device is not None and not n.writing and n.loading is None:
                self._write_async(n)

    def _host_pages_like(self, device_pages: list[int]) -> list[int] | None:
        """Host pages for copies of ``device_pages``, each of its device page's owner."""
        return until_fits(lambda: alloc_like(self.host.allocator, device_pages),
                          lambda: self._evict_host(len(device_pages)))

    def _host_pages_after(self, previous: Sequence[int], n: int) -> list[int] | None:
        """``n`` host pages continuing the rotation of ``previous`` (an L3 prefetch's)."""
        return until_fits(lambda: alloc_continuing(self.host.allocator, previous, n), lambda: self._evict_host(n))

    def _evict_host(self, wanted: int) -> int:
        """Evicts L2 pages towards ``wanted`` free ones (at least one); returns how many went."""
        evicted = self.tree.evict_host(max(1, wanted - self.host.allocator.num_free))
        self.host.allocator.free(evicted)
        return len(evicted)

    def _copy(self, device_pages: list[int], host_pages: list[int], to_host: bool,
              layers: range | None = None) -> None:
        """Copies between L1 and L2 the pairs this rank stores (under CP, those it owns)."""
        if self.ownership.size > 1:
            device_pages, host_pages = owned_pairs(self.ownership, device_pages, host_pages)
        for device, host, selected in planes(self.device, self.host, self.sidecar, layers):  # a sidecar's too
            copy_pages(device, host, device_pages, host_pages, to_host, self.config.io_backend, selected)

    def _write_async(self, node: Node) -> None:
        device_pages = list(node.device)
        host_pages = self._host_pages_like(device_pages)
        if host_pages is None:
            return  # L2 is full of pinned pages: stay L1-only for now
        node.writing = True
        self.tree.lock(node)
        future = self._worker.submit(_timed, self._copy, device_pages, host_pages, True)
        self._writes.append(_Write(node, host_pages, future, list(node.keys)))

    def _write_back_ahead(self) -> None:
        """Write-back: when free L1 pages run low, copies the least recently used L1-only nodes to
        L2 in the background (landing like any write, then backed up to L3), so eviction finds
        them clean instead of copying on the engine thread."""
        if self.config.write_policy is not WritePolicy.WRITE_BACK or self._writes:
            return
        short = int(self.allocator.num_pages * WRITE_BACK_LOW_WATERMARK) - self.allocator.num_free
        for node in dirty_lru(self.tree, short) if short > 0 else []:
            self._write_async(node)

    def _write_now(self, node: Node) -> bool:
        """Write-back's fallback when an L1 victim is still dirty: copies it to L2 on the engine
        thread (counted: a high count means the watermark is too low), then backs it up to L3."""
        host_pages = self._host_pages_like(list(node.device))
        if host_pages is None:
            return False
        self._copy(list(node.device), host_pages, True)
        self.tree.set_host(node, host_pages)
        self.counters["l2_write_pages_total"] += len(host_pages)
        self.counters["l2_write_back_sync_pages_total"] += len(host_pages)
        if self.storage is not None:  # pinned until the backup lands, so L2 keeps it meanwhile
            self.tree.lock(node)
            self.storage.backup(node, list(node.keys), host_pages)
        return True

    # -- L2 -> L1 ------------------------------------------------------------------------------

    def _load(self, nodes: list[Node], host_pages: list[int]) -> LayerwiseLoad | None:
        device_pages = self._device_pages_like(host_pages)
        if device_pages is None:
            return None
        load = LayerwiseLoad(load_layers(self.device, self.sidecar))  # its events cover a sidecar's copies
        start = 0
        for n in nodes:
            self.tree.set_device(n, device_pages[start : start + n.num_pages])
            n.loading = load
            start += n.num_pages
        load.nodes = list(nodes)

        def copy_layer(i: int) -> None:
            self._copy(device_pages, host_pages, False, range(i, i + 1))

        self._loader.submit(load.run, copy_layer)
        self.loads.started(load)
        self.counters["l2_load_pages_total"] += len(host_pages)
        return load

    def _device_pages_like(self, host_pages: list[int]) -> list[int] | None:
        """Device pages to restore ``host_pages`` into, each of its host page's owner (so that the
        owner restores it), evicting L1 until they fit or nothing more goes."""
        return until_fits(lambda: alloc_like(self.allocator, host_pages),
                          lambda: self.evict(max(1, len(host_pages) - self.allocator.num_free)))


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _l3_bytes(l3: dict[str, float], page_bytes: int) -> dict[str, float]:
    """The L3 tier's counters plus its bytes written and read (this rank's share of each page, as
    for L2), for the bandwidth panels; no L3: nothing added."""
    if "l3_backup_pages_total" not in l3:
        return l3
    return l3 | {"l3_backup_bytes_total": l3["l3_backup_pages_total"] * page_bytes,
                 "l3_prefetch_bytes_total": l3["l3_prefetch_pages_total"] * page_bytes}
