"""Test-only L3 faults for one rank: a store that shows fewer pages, fails reads past a count,
reads or writes slowly, whose writes never return, or cannot be reached at all (``docs/ranks.md``).
Enabled by the ``fault_injection`` object of the tests' fault file (``core/test_hooks.py``), for the
ranks it names; a node's config cannot."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierserve.cache.storage.base import StorageBackend


@dataclass(frozen=True)
class StorageFaults:
    """``exists_cap``: a probe finds at most this many leading objects; ``get_cap``: a read call
    fails every object after its first ``get_cap``; ``get_delay_s``: each read call sleeps first;
    ``set_delay_s``: each write call sleeps first (a backup stays in flight); ``unreachable``:
    creating the backend fails (as a store that refuses the rank's client would); ``hang_writes``:
    every write call blocks for ever (a store that stopped answering: shutdown must still end,
    ``cache/lanes.py``); ``hold_reads_until``: every read call blocks until a file exists at this
    path (a store that stopped answering reads; the test creates the file to let them return, so
    it can see what a stuck prefetch leaves behind). ``ranks``: the ranks that suffer them."""

    ranks: tuple[int, ...] = ()
    exists_cap: int | None = None
    get_cap: int | None = None
    get_delay_s: float = 0.0
    set_delay_s: float = 0.0
    unreachable: bool = False
    hang_writes: bool = False
    hold_reads_until: str | None = None

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> StorageFaults:
        """From the tests' ``fault_injection`` object (None: no faults)."""
        raw = raw or {}
        cap = {k: int(raw[k]) for k in ("exists_cap", "get_cap") if raw.get(k) is not None}
        delays = {k: float(raw[k]) for k in ("get_delay_s", "set_delay_s") if raw.get(k) is not None}
        return cls(tuple(int(r) for r in raw.get("ranks", ())), unreachable=bool(raw.get("unreachable", False)),
                   hang_writes=bool(raw.get("hang_writes", False)), hold_reads_until=raw.get("hold_reads_until"),
                   **cap, **delays)


class FaultyStorage(StorageBackend):
    """``inner`` with ``faults`` applied to its probes, reads and writes."""

    def __init__(self, inner: StorageBackend, faults: StorageFaults) -> None:
        self.inner, self.faults = inner, faults
        self.put_skips_existing = inner.put_skips_existing

    def batch_exists(self, keys: list[bytes]) -> int:
        found = self.inner.batch_exists(keys)
        return found if self.faults.exists_cap is None else min(found, self.faults.exists_cap)

    def exists_each(self, keys: list[bytes]) -> list[bool]:
        if self.faults.exists_cap is not None:  # a store that shows fewer pages shows no others either
            return [False] * len(keys)
        return self.inner.exists_each(keys)

    def batch_get_into(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        if self.faults.hold_reads_until is not None:
            _hold_until(Path(self.faults.hold_reads_until))
        time.sleep(self.faults.get_delay_s)
        cap = len(keys) if self.faults.get_cap is None else self.faults.get_cap
        got = self.inner.batch_get_into(keys[:cap], spans[:cap])
        return got + [False] * (len(keys) - len(got))

    def batch_set_from(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        if self.faults.hang_writes:
            threading.Event().wait()  # never set: the call never returns
        time.sleep(self.faults.set_delay_s)
        return self.inner.batch_set_from(keys, spans)

    def get(self, key: bytes) -> bytes | None:
        return self.inner.get(key)

    def set(self, key: bytes, data: bytes) -> bool:
        return self.inner.set(key, data)

    def clear(self) -> None:
        self.inner.clear()

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()

    def attach_host_buffer(self, buffer: torch.Tensor) -> None:
        self.inner.attach_host_buffer(buffer)


HOLD_POLL_S = 0.02  # how often a held read looks for its release file


def _hold_until(release: Path) -> None:
    """Blocks the calling thread until ``release`` exists, with no bound: a store call that does not
    return until the test says so."""
    while not release.exists():
        time.sleep(HOLD_POLL_S)
