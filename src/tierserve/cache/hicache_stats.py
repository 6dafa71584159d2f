"""HiCache's counters and gauges for ``/metrics`` (``PrefixCache.stats``): pages per tier, bytes
copied, L3 backups, prefetch decisions and failures."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierserve.cache.hicache import HiCache


def hicache_stats(cache: HiCache) -> dict[str, float]:
    """Every counter of ``cache``, the host pool's occupancy (whole and this rank's own share) and,
    with L3, its tier's counters."""
    page = cache.device.geometry.bytes_per_page
    out: dict[str, float] = dict(cache.counters)
    out["host_pages_used"] = cache.host.allocator.num_used
    out["host_pages_total"] = cache.host.allocator.num_pages
    out |= _rank_host_stats(cache)
    out["l2_write_bytes_total"] = cache.counters["l2_write_pages_total"] * page
    out["l2_load_bytes_total"] = cache.counters["l2_load_pages_total"] * page
    out["l2_load_failures_total"] = cache.loads.failures
    if cache.storage is not None:
        out |= _storage_stats(cache)
    return out


def _rank_host_stats(cache: HiCache) -> dict[str, float]:
    """What this rank's own host pool holds (under CP its share of the logical pages)."""
    used = cache.host.allocator.num_used
    if cache.ownership.size > 1:
        used = cache.host.allocator.num_used_by(cache.ownership.rank)
    return {"host_rank_pages_used": used, "host_rank_pages_total": cache.host.num_pages}


def _storage_stats(cache: HiCache) -> dict[str, float]:
    tier = cache.storage
    return {"l3_backup_pages_total": tier.backed_up_pages, "l3_prefetch_pages_total": tier.prefetched_pages,
            "l3_prefetch_wait_decisions_total": tier.decisions["wait"],
            "l3_prefetch_no_wait_decisions_total": tier.decisions["no_wait"],
            "l3_failures_total": tier.failures, "l3_healthy": float(tier.healthy),
            "l3_integrity_failures_total": getattr(tier.storage, "integrity_failures", 0)}
