"""The test-only transfer faults (``transfer/faulty.py``) with a fake link: they spoil a handoff's
first batch only, pick exactly their share of handoffs, and leave handoffs without faults alone."""

from __future__ import annotations

from tierserve.transfer.engine import EntryBudget
from tierserve.transfer.faulty import NO_FAULTS, UNREGISTERED, FaultyPeers, HandoffFaults, picked, with_faults
from tierserve.transfer.layout import Block


class _Link:
    def __init__(self) -> None:
        self.sent: list[list[Block]] = []

    def submit(self, target: str, blocks: list[Block]) -> int:
        self.sent.append(blocks)
        return len(self.sent)

    def wait(self, batch: int) -> bool:
        return True


class _Peers:
    def __init__(self) -> None:
        self.link, self.budgets = _Link(), EntryBudget()

    def acquire(self, target: str) -> _Link:
        return self.link

    def release(self, target: str) -> None:
        pass

    def budget(self, target: str) -> EntryBudget:
        return self.budgets


K, V = [(100, 1000, 8), (108, 1008, 8)], [(200, 2000, 8), (208, 2008, 8)]


def test_no_faults_wrap_nothing() -> None:
    peers = _Peers()
    assert with_faults(peers, NO_FAULTS) is peers


def test_a_failing_handoff_aims_its_first_block_nowhere_once() -> None:
    peers = _Peers()
    faulty = FaultyPeers(peers, HandoffFaults(rate=1.0))
    link = faulty.acquire("d")
    link.submit("d", K + V)
    link.submit("d", K + V)
    assert peers.link.sent == [[(100, UNREGISTERED, 8), *K[1:], *V], K + V]


def test_a_corrupting_handoff_swaps_the_first_k_and_v_destinations_once() -> None:
    peers = _Peers()
    link = FaultyPeers(peers, HandoffFaults(corrupt_rate=1.0)).acquire("d")
    link.submit("d", K + V)
    link.submit("d", K + V)
    assert peers.link.sent == [[(100, 2000, 8), K[1], (200, 1000, 8), V[1]], K + V]


def test_rates_pick_exactly_their_share_of_handoffs() -> None:
    assert [n for n in range(8) if picked(n, 0.5)] == [1, 3, 5, 7]
    assert [n for n in range(8) if picked(n, 0.25)] == [3, 7]
    assert not any(picked(n, 0.0) for n in range(8))
