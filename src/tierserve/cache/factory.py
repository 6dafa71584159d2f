"""Builds the prefix cache an engine asked for: the one place a cache is assembled."""

from __future__ import annotations

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.base import NoPrefixCache, PrefixCache
from tierserve.cache.device_pool import DeviceKVPool
from tierserve.cache.hicache import HiCache, HiCacheConfig
from tierserve.cache.host_pool import HostKVPool
from tierserve.cache.options import CacheKind, HiCacheOptions
from tierserve.cache.prefetch import PrefetchOptions
from tierserve.cache.radix_cache import RadixCache
from tierserve.cache.storage import create_backend


def build_cache(kind: CacheKind, allocator: PageAllocator, pool: DeviceKVPool, seed: bytes,
                options: HiCacheOptions) -> PrefixCache:
    """The cache of ``kind`` over ``pool`` (whose pages ``allocator`` hands out), keyed under the
    namespace ``seed``; ``options`` configure the host tier and L3 of the hierarchical cache."""
    if kind is CacheKind.NONE:
        return NoPrefixCache(allocator)
    if kind is CacheKind.RADIX:
        return RadixCache(allocator, pool.page_size, seed)
    pinned = pool.buffer.device.type == "cuda"  # pinned host memory: asynchronous device copies
    host = HostKVPool(pool.geometry, host_pages(options, pool), options.mem_layout, pin_memory=pinned)
    storage = create_backend(options.storage_backend, options.storage_config) if options.storage_backend else None
    return HiCache(allocator, pool, host, seed, hicache_config(options), storage)


def host_pages(options: HiCacheOptions, pool: DeviceKVPool) -> int:
    """L2 size in pages: ``size_gb`` when given, else ``ratio`` x the device pool."""
    if options.size_gb is not None:
        return max(1, int(options.size_gb * 2**30) // pool.geometry.bytes_per_page)
    return max(1, int(pool.num_pages * options.ratio))


def hicache_config(options: HiCacheOptions) -> HiCacheConfig:
    """The tier controller's settings; the extra config may override the prefetch thresholds."""
    extra = options.storage_config
    prefetch = PrefetchOptions(
        threshold_tokens=int(extra.get("prefetch_threshold", PrefetchOptions.threshold_tokens)),
        timeout_base=float(extra.get("prefetch_timeout_base", 2.0)),
        timeout_per_ki_token=float(extra.get("prefetch_timeout_per_ki_token", 0.1)),
        timeout_max=float(extra.get("prefetch_timeout_max", 30.0)),
    )
    return HiCacheConfig(options.write_policy, options.io_backend, options.write_threshold, options.prefetch_policy,
                         prefetch)
