"""Builds the prefix cache an engine asked for: the one place a cache is assembled."""

from __future__ import annotations

import dataclasses
from typing import Any

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.base import NoPrefixCache, PrefixCache
from tierserve.cache.device_pool import DeviceKVPool
from tierserve.cache.draft_kv import DraftShard, SidecarKV
from tierserve.cache.hicache import HiCache, HiCacheConfig
from tierserve.cache.host_pool import HostKVPool, host_page_bytes
from tierserve.cache.options import CacheKind, HiCacheOptions
from tierserve.cache.prefetch import PrefetchOptions
from tierserve.cache.radix_cache import RadixCache
from tierserve.cache.sharded.agreement import Agreement, SingleRank
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.cache.sharded.shards import KVShard, finer_chunks
from tierserve.cache.storage import StorageBackend, StorageError, create_backend
from tierserve.cache.storage.faulty import FaultyStorage, StorageFaults
from tierserve.core.storage import StorageKind
from tierserve.core.test_hooks import FaultSwitch, injected, refuse_test_switches

# Extra-config key: the TP sizes of the nodes sharing this L3 (docs/tp.md).
L3_TP_SIZES = "l3_tp_sizes"


def build_cache(kind: CacheKind, allocator: PageAllocator, pool: DeviceKVPool, seed: bytes,
                options: HiCacheOptions, shard: KVShard | None = None,
                agreement: Agreement | None = None, ownership: PageOwnership | None = None,
                draft: DeviceKVPool | None = None, draft_shard: DraftShard | None = None) -> PrefixCache:
    """The cache of ``kind`` over ``pool`` (whose pages ``allocator`` hands out), keyed under the
    namespace ``seed``; ``options`` configure the host tier and L3 of the hierarchical cache.

    Several ranks: ``shard`` is this rank's heads of every page and ``agreement`` the collective
    over the node's ranks (``docs/ranks.md``); every rank must call
    this with the same ``kind`` and ``options``, as it runs one collective (L2's page count).
    ``ownership``: a CP rank's pages (its L1 and, in the hierarchical cache, its L2 and L3 copies:
    each rank's host pool holds the agreed page count of its own pages, ``cache/sharded/cp_host.py``).
    ``draft``: a speculative draft's own device pool (the sidecar layout): the hierarchical cache
    gives it a host pool of L2's page count and copies it with the target's pages; ``draft_shard``:
    this rank's share of the draft's rows (its heads, which its L3 objects are named by; default: all)."""
    if kind is CacheKind.NONE:
        return NoPrefixCache(allocator)
    if kind is CacheKind.RADIX:
        return RadixCache(allocator, pool.page_size, seed, ownership)
    agreement = agreement or SingleRank()
    shard = cluster_shard(shard or KVShard.whole(pool.geometry.num_kv_heads), options.storage_config)
    pinned = pool.buffer.device.type == "cuda"  # pinned host memory: asynchronous device copies
    # host page ids are the same on every rank, so every rank's L2 has the smallest rank's count
    num_host = agreement.min([host_pages(options, pool, draft)])[0]
    host = HostKVPool(pool.geometry, num_host, options.mem_layout, pin_memory=pinned, ownership=ownership)
    storage = rank_backend(options.storage_backend, options.storage_config, shard) if options.storage_backend \
        else None
    if injected(FaultSwitch.SKIP_AGREEMENT):  # tests only (docs/faults.md): shows what the agreement prevents
        agreement = SingleRank()
    sidecar = SidecarKV.beside(draft, host, pinned, draft_shard) if draft is not None else None
    return HiCache(allocator, pool, host, seed, hicache_config(options), storage, agreement, shard, ownership, sidecar)


def cluster_shard(shard: KVShard, config: dict) -> KVShard:
    """``shard`` with the finer objects it also writes for the ranks of the extra config's
    ``l3_tp_sizes`` that hold fewer heads (none without the key: one object per page and rank)."""
    sizes = config.get(L3_TP_SIZES) or []
    if not isinstance(sizes, list) or not all(isinstance(t, int) for t in sizes):
        raise ValueError(f"{L3_TP_SIZES} must be a list of TP sizes, not {sizes!r}")
    return dataclasses.replace(shard, finer=finer_chunks(shard.heads, sizes))


def rank_backend(kind: StorageKind | str, extra: dict[str, Any], shard: KVShard) -> StorageBackend:
    """This rank's L3 backend of ``kind`` from the extra config ``extra`` (at start-up and on a
    run-time attach; ``ValueError`` when it names a test-only switch), wrapped in the tests' injected
    faults when they name this rank (``core/test_hooks.py``). Each rank has its own client: a
    ``global_segment_size`` given is the node's, split between its ranks (``tierserve up`` sizes L3 per node)."""
    refuse_test_switches(extra)
    config = dict(extra)
    if "global_segment_size" in config:
        config["global_segment_size"] = int(config["global_segment_size"]) // shard.ranks
    faults = StorageFaults.parse(injected(FaultSwitch.STORAGE_FAULTS))
    mine = shard.rank in faults.ranks
    if mine and faults.unreachable:
        raise StorageError(f"test fault: rank {shard.rank} cannot reach the store")
    backend = create_backend(kind, config)
    return FaultyStorage(backend, faults) if mine else backend


def host_pages(options: HiCacheOptions, pool: DeviceKVPool, draft: DeviceKVPool | None = None) -> int:
    """L2 size in pages: ``size_gb`` when given (a sidecar ``draft``'s host pages count in it),
    else ``ratio`` x the device pool."""
    if options.size_gb is not None:
        pools = [pool] if draft is None else [pool, draft]
        page = sum(host_page_bytes(p.geometry, options.mem_layout) for p in pools)
        return max(1, int(options.size_gb * 2**30) // page)
    return max(1, int(pool.num_pages * options.ratio))


def hicache_config(options: HiCacheOptions) -> HiCacheConfig:
    """The tier controller's settings; the extra config may override the prefetch thresholds."""
    extra = options.storage_config
    prefetch = PrefetchOptions(
        threshold_tokens=int(extra.get("prefetch_threshold", PrefetchOptions.threshold_tokens)),
        timeout_base=float(extra.get("prefetch_timeout_base", PrefetchOptions.timeout_base)),
        timeout_per_ki_token=float(extra.get("prefetch_timeout_per_ki_token", PrefetchOptions.timeout_per_ki_token)),
        timeout_max=float(extra.get("prefetch_timeout_max", PrefetchOptions.timeout_max)),
    )
    return HiCacheConfig(options.write_policy, options.io_backend, options.write_threshold, options.prefetch_policy,
                         prefetch)
