"""Faults the engine machine (``test_engine_machine``) injects into a real engine's cache: failed
host-memory copies on the copy threads and an unreachable L3."""

from __future__ import annotations

import threading
from collections.abc import Callable

from tierserve.cache.hicache import HiCache
from tierserve.cache.storage.base import StorageError
from tierserve.cache.storage.file import FileStorage


class Faults:
    """``copies``: armed copy failures by direction (to host or not), each failing the next copy
    of that direction on a copy thread once; ``l3_down``: every L3 call raises."""

    def __init__(self) -> None:
        self.copies: set[bool] = set()
        self.l3_down = False

    def inject(self, cache: HiCache) -> None:
        self._into_copies(cache)
        self._into_l3(cache.storage.storage)

    def _into_copies(self, cache: HiCache) -> None:
        """The engine thread's own copies never fail: only the copy threads' writes and loads."""
        real = cache._copy

        def copy(device_pages: list[int], host_pages: list[int], to_host: bool, layers: range | None = None) -> None:
            if to_host in self.copies and threading.current_thread().name.startswith("hicache-"):
                self.copies.discard(to_host)
                raise OSError("injected host copy failure")
            real(device_pages, host_pages, to_host, layers)

        cache._copy = copy

    def _into_l3(self, backend: FileStorage) -> None:
        """The file store's probes, reads and writes (its own methods call these, so the tier's
        calls fail whichever it makes)."""
        for name in ("batch_exists", "_read_into", "_write"):
            setattr(backend, name, self._unless_down(getattr(backend, name)))

    def _unless_down(self, call: Callable) -> Callable:
        def guarded(*args: object) -> object:
            if self.l3_down:
                raise StorageError("injected L3 outage")
            return call(*args)

        return guarded
