"""The L3 slot of a ``HiCache``: empty, or one ``StorageTier`` behind the host tier, attached,
detached and cleared at run time (the admin RPCs and ``/admin/storage``, ``docs/cache.md``).
Engine thread; attach, detach and clear only while the cache copies nothing between tiers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tierserve.cache.storage import StorageBackend
from tierserve.cache.storage_tier import StorageTier, nothing
from tierserve.core.storage import StorageAction, StorageBusyError


class L3Slot:
    """Holds the cache's L3 tier (``tier``; None: no L3). ``make`` builds a tier over a backend (the
    cache's pools and tree); ``busy`` says whether the cache copies pages between tiers, the tier's
    own work included. The engine's waker (``set_waker``) is handed to every tier attached."""

    def __init__(self, make: Callable[[StorageBackend], StorageTier], busy: Callable[[], bool]) -> None:
        self._make, self._busy = make, busy
        self.tier: StorageTier | None = None
        self.wake: Callable[[], None] = nothing

    def set_waker(self, wake: Callable[[], None]) -> None:
        """``PrefixCache.set_waker``: the L3 tier, now and once attached, wakes the engine."""
        self.wake = wake
        if self.tier is not None:
            self.tier.wake = wake

    def admin(self, action: StorageAction, backend: StorageBackend | None = None) -> dict[str, Any]:
        """``PrefixCache.storage_admin``: runs ``action``, then answers the status."""
        if action is StorageAction.ATTACH:
            if backend is None:
                raise ValueError("attach needs a storage backend")
            self.attach(backend)
        elif action is StorageAction.DETACH:
            self.detach()
        elif action is StorageAction.CLEAR:
            self.clear()
        return self.status()

    def attach(self, backend: StorageBackend) -> None:
        """Puts ``backend`` behind L2; refused while another backend is attached or L2/L3 work runs."""
        self._require_idle()
        if self.tier is not None:
            raise StorageBusyError("an L3 backend is already attached: detach it first")
        self.tier = self._make(backend)
        self.tier.wake = self.wake

    def detach(self) -> None:
        self._require_idle()
        if self.tier is None:
            raise StorageBusyError("no L3 backend is attached")
        tier, self.tier = self.tier, None  # detached even if closing the client fails
        tier.close()

    def clear(self) -> None:
        self._require_idle()
        if self.tier is None:
            raise StorageBusyError("no L3 backend is attached")
        self.tier.storage.clear()

    def status(self) -> dict[str, Any]:
        tier = self.tier
        if tier is None:
            return {"attached": False}
        return {"attached": True, "healthy": tier.healthy, "failures": tier.failures,
                "backed_up_pages": tier.backed_up_pages, "prefetched_pages": tier.prefetched_pages,
                "backend": tier.storage.stats()}

    def stats(self) -> dict[str, float]:
        """The tier's metrics (``StorageTier.stats``); none without L3."""
        return self.tier.stats() if self.tier is not None else {}

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()

    def _require_idle(self) -> None:
        if self._busy():
            raise StorageBusyError("the cache is copying pages between tiers: retry when idle")
