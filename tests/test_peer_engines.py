"""``PeerEngines``: real Mooncake transfer engines, one per destination peer, bounded in number
(the least recently used unused one is closed) and started under a lock of their own peer."""

from __future__ import annotations

import threading

import pytest
import torch

from tierserve.core.transfer import TransferProtocol
from tierserve.transfer.engine import PeerEngines, TransferEngineHandle


@pytest.fixture
def peers() -> PeerEngines:
    return PeerEngines("127.0.0.1", TransferProtocol.TCP, "", [torch.zeros(4096, dtype=torch.uint8)], max_peers=2)


def test_engines_are_bounded_and_an_engine_in_use_is_never_closed(peers: PeerEngines) -> None:
    held = peers.acquire("10.0.0.1:1")  # a handoff to this peer is running
    for i in range(2, 6):  # pod churn: peers come and go
        peers.acquire(f"10.0.0.{i}:1")
        peers.release(f"10.0.0.{i}:1")
    assert len(peers) == 2 and peers.closed == 3
    assert peers.acquire("10.0.0.1:1") is held  # still the same, still open
    peers.release("10.0.0.1:1")
    peers.release("10.0.0.1:1")


def test_a_peer_whose_engine_hangs_in_start_does_not_block_another(peers: PeerEngines,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    hang, started = threading.Event(), threading.Event()
    real_start = peers._start

    def start(target: str) -> TransferEngineHandle:
        if target == "frozen:1":
            started.set()
            hang.wait(30)
        return real_start(target)

    monkeypatch.setattr(peers, "_start", start)
    frozen = threading.Thread(target=peers.acquire, args=("frozen:1",))
    frozen.start()
    assert started.wait(10)
    other = threading.Thread(target=peers.acquire, args=("healthy:1",))
    other.start()
    other.join(timeout=10)
    alive = other.is_alive()
    hang.set()
    frozen.join(timeout=30)
    assert not alive, "starting one peer's engine waited on another peer's"


def test_the_entries_budget_waits_for_room_and_never_refuses_an_idle_engine() -> None:
    from tierserve.transfer.engine import EntryBudget

    budget = EntryBudget(limit=100)
    assert budget.take(5000, block=False)  # alone on the engine: one batch bigger than the limit still goes
    assert not budget.take(1, block=False)
    budget.give(5000)
    assert budget.take(60, block=False) and not budget.take(60, block=False)
    waiter = threading.Thread(target=budget.take, args=(60, True))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # no room yet
    budget.give(60)
    waiter.join(5)
    assert not waiter.is_alive() and budget.used == 60
