"""Test-only transfer faults for a prefill node's handoffs (``docs/faults.md``): a handoff whose
first batch fails for real, lands late, or writes wrong bytes. They wrap the ``Peers`` a
``KVHandoff`` submits through, as ``cache/storage/faulty.py`` wraps a storage backend, so the
handoff itself has no fault code. Reachable from tests only: the ``handoff_faults`` key of the
tests' fault file (``core/test_hooks.py``), read by the prefill node at start; never a flag."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, fields

from tierserve.core.test_hooks import FaultSwitch, injected
from tierserve.transfer.engine import EntryBudget, Link, Peers
from tierserve.transfer.layout import Block

_handoffs = itertools.count()  # numbers the handoffs with faults: which ones fail is deterministic
UNREGISTERED = 64  # an address no peer registered: a block aimed there fails at once


@dataclass(frozen=True)
class HandoffFaults:
    """``rate``: exactly that share of handoffs (every 1/rate-th) fails for real (one block aimed
    at an address the peer never registered); ``delay_s``: each handoff's first batch is held that
    long before it is written, as a slow link would (a ``cancel`` meanwhile does not stop it, as it
    cannot stop a batch already on the wire); ``corrupt_rate``: that share of handoffs writes one
    layer's first K block where its V goes and back (bytes that land wrong, for the digests check)."""

    rate: float = 0.0
    delay_s: float = 0.0
    corrupt_rate: float = 0.0

    @property
    def any(self) -> bool:
        return bool(self.rate or self.delay_s or self.corrupt_rate)


NO_FAULTS = HandoffFaults()


def injected_handoff_faults() -> HandoffFaults:
    """The handoff faults the tests' fault file gives (``{"handoff_faults": {"rate": 0.1}}``, the
    fields of ``HandoffFaults``); ``NO_FAULTS`` without one. ``ValueError`` for an unknown field."""
    given = injected(FaultSwitch.HANDOFF_FAULTS) or {}
    unknown = set(given) - {f.name for f in fields(HandoffFaults)}
    if unknown:
        raise ValueError(f"unknown handoff fault fields {sorted(unknown)} in the tests' fault file")
    return HandoffFaults(**given)


def with_faults(peers: Peers, faults: HandoffFaults) -> Peers:
    """The peers one new handoff submits through: ``peers`` itself when there are no faults."""
    return FaultyPeers(peers, faults) if faults.any else peers


class FaultyPeers:
    """``inner`` for one handoff, whose first batch gets ``faults`` (whichever peer it goes to)."""

    def __init__(self, inner: Peers, faults: HandoffFaults) -> None:
        n = next(_handoffs)
        self.inner = inner
        self._delay_s = faults.delay_s
        self._fail = picked(n, faults.rate)
        self._corrupt = picked(n, faults.corrupt_rate)

    def acquire(self, target: str) -> Link:
        return _FaultyLink(self.inner.acquire(target), self)

    def release(self, target: str) -> None:
        self.inner.release(target)

    def budget(self, target: str) -> EntryBudget:
        return self.inner.budget(target)

    def spoil(self, blocks: list[Block]) -> list[Block]:
        """A batch as the faults make it (the sender thread, before it submits; once each)."""
        if self._delay_s:
            time.sleep(self._delay_s)  # a batch that lands late
            self._delay_s = 0.0
        if self._fail:
            self._fail = False
            blocks = [(blocks[0][0], UNREGISTERED, blocks[0][2]), *blocks[1:]]
        if self._corrupt:
            self._corrupt = False
            blocks = _swapped(blocks)
        return blocks


class _FaultyLink:
    """A link whose batches go through ``FaultyPeers.spoil`` first."""

    def __init__(self, inner: Link, peers: FaultyPeers) -> None:
        self.inner, self.peers = inner, peers

    def submit(self, target: str, blocks: list[Block]) -> int:
        return self.inner.submit(target, self.peers.spoil(blocks))

    def wait(self, batch: int) -> bool:
        return self.inner.wait(batch)


def picked(n: int, rate: float) -> bool:
    """Whether handoff ``n`` is one of the ``rate`` share that suffers a fault."""
    return int((n + 1) * rate) > int(n * rate)


def _swapped(blocks: list[Block]) -> list[Block]:
    """The first block (a K run) and the middle one (the same run's V) trade destinations, so the
    peer's pages hold wrong bytes while the transfer succeeds."""
    m = len(blocks) // 2
    if m == 0 or blocks[0][2] != blocks[m][2]:
        return blocks
    (s0, d0, n), (sm, dm, _) = blocks[0], blocks[m]
    return [(s0, dm, n), *blocks[1:m], (sm, d0, n), *blocks[m + 1:]]
