"""Run-time L3 control of a ``HiCache`` (attach, detach, clear, status): the admin RPCs and
``/admin/storage`` (``docs/pd.md``). Engine thread, idle cache only."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tierserve.cache.storage import StorageBackend
from tierserve.cache.storage_tier import StorageTier
from tierserve.core.storage import StorageAction, StorageBusyError

if TYPE_CHECKING:
    from tierserve.cache.draft_kv import SidecarKV
    from tierserve.cache.hicache import HiCacheConfig
    from tierserve.cache.host_pool import HostKVPool
    from tierserve.cache.radix_tree import RadixTree
    from tierserve.cache.sharded.cp_pages import PageOwnership
    from tierserve.cache.sharded.shards import KVShard


class StorageAdmin:
    """The L3 admin half of ``HiCache`` (a mixin over its attributes below)."""

    storage: StorageTier | None
    sidecar: SidecarKV | None
    host: HostKVPool
    tree: RadixTree
    config: HiCacheConfig
    shard: KVShard
    ownership: PageOwnership
    _host_pages_after: Callable[[Sequence[int], int], list[int] | None]
    wake: Callable[[], None]

    @property
    def busy(self) -> bool:
        raise NotImplementedError

    def set_waker(self, wake: Callable[[], None]) -> None:
        """``PrefixCache.set_waker``: the L3 tier, now and once attached, wakes the engine."""
        self.wake = wake
        if self.storage is not None:
            self.storage.wake = wake

    def storage_admin(self, action: StorageAction, backend: StorageBackend | None = None) -> dict[str, Any]:
        if action is StorageAction.ATTACH:
            if backend is None:
                raise ValueError("attach needs a storage backend")
            self.attach_storage(backend)
        elif action is StorageAction.DETACH:
            self.detach_storage()
        elif action is StorageAction.CLEAR:
            self.clear_storage()
        return self.storage_status()

    def attach_storage(self, storage: StorageBackend) -> None:
        """Puts ``storage`` behind L2; refused while another backend is attached or L2/L3 work runs."""
        self._require_idle()
        if self.storage is not None:
            raise StorageBusyError("an L3 backend is already attached: detach it first")
        self.storage = StorageTier(storage, self.host, self.tree, self.config.prefetch, self._host_pages_after,
                                   self.shard, self.ownership, self.sidecar.host if self.sidecar else None)
        self.storage.wake = self.wake

    def detach_storage(self) -> None:
        self._require_idle()
        if self.storage is None:
            raise StorageBusyError("no L3 backend is attached")
        tier, self.storage = self.storage, None  # detached even if closing the client fails
        tier.close()

    def clear_storage(self) -> None:
        self._require_idle()
        if self.storage is None:
            raise StorageBusyError("no L3 backend is attached")
        self.storage.storage.clear()

    def storage_status(self) -> dict[str, Any]:
        if self.storage is None:
            return {"attached": False}
        return {"attached": True, "healthy": self.storage.healthy, "failures": self.storage.failures,
                "backed_up_pages": self.storage.backed_up_pages, "prefetched_pages": self.storage.prefetched_pages,
                "backend": self.storage.storage.stats()}

    def _require_idle(self) -> None:
        if self.busy:
            raise StorageBusyError("the cache is copying pages between tiers: retry when idle")
