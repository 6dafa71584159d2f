"""The router's circuit breaker (``Registry.failed`` / ``succeeded``, ``BreakerOptions``) on a
registry with a fake clock: consecutive failures open it for ``open_s``, it closes after, a
success resets the count, an unreachable worker waits for a health check."""

from __future__ import annotations

import pytest

from tierserve.proto import tierserve_pb2 as pb
from tierserve.router import registry as registry_module
from tierserve.router.registry import BreakerOptions, Registry, Worker, WorkerState
from tierserve.router.roles import Role


class Clock:
    """Stands in for the registry's ``time`` module: ``monotonic`` is whatever ``now`` says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(registry_module, "time", fake)
    return fake


def _registry(failures: int = 3, open_s: float = 10.0) -> tuple[Registry, Worker]:
    """A registry with one healthy decode worker (no channel: the breaker never calls it)."""
    registry = Registry(breaker=BreakerOptions(failures=failures, open_s=open_s))
    worker = Worker(Role.DECODE, "127.0.0.1:1", channel=None, state=WorkerState.HEALTHY)
    registry.workers[(worker.role, worker.address)] = worker
    return registry, worker


def test_the_defaults_are_the_documented_three_failures_and_ten_seconds() -> None:
    assert (BreakerOptions().failures, BreakerOptions().open_s) == (3, 10.0)


def test_failures_in_a_row_open_the_breaker_for_open_s_then_it_closes(clock: Clock) -> None:
    registry, worker = _registry(failures=3, open_s=10.0)
    for _ in range(2):
        registry.failed(worker, "UNAVAILABLE")
    assert registry.available(Role.DECODE) == [worker], "two failures do not open it"
    registry.failed(worker, "UNAVAILABLE")
    assert registry.available(Role.DECODE) == [] and not worker.available
    assert worker.state is WorkerState.HEALTHY and worker.reason == "UNAVAILABLE"  # open, not unhealthy
    clock.now += 9.9
    assert not worker.available, "still open before open_s"
    clock.now += 0.1
    assert registry.available(Role.DECODE) == [worker], "closed once open_s passed"


def test_a_success_resets_the_count(clock: Clock) -> None:
    registry, worker = _registry(failures=3)
    for _ in range(2):
        registry.failed(worker, "DEADLINE_EXCEEDED")
    registry.succeeded(worker)
    assert worker.failures == 0
    for _ in range(2):
        registry.failed(worker, "DEADLINE_EXCEEDED")
    assert worker.available, "the failures before the success do not count"
    registry.failed(worker, "DEADLINE_EXCEEDED")
    assert not worker.available


def test_an_open_breaker_is_not_extended_by_failures_while_open(clock: Clock) -> None:
    """Requests already in flight may fail after it opened: it still closes ``open_s`` after it
    opened, not after the last of them."""
    registry, worker = _registry(failures=1, open_s=10.0)
    registry.failed(worker, "ABORTED")
    clock.now += 5
    registry.failed(worker, "ABORTED")
    clock.now += 5
    assert worker.available


def test_an_unreachable_worker_gets_no_traffic_until_a_health_check_passes(clock: Clock) -> None:
    registry, worker = _registry(failures=3)
    registry.failed(worker, "connection refused", unreachable=True)
    assert worker.state is WorkerState.UNHEALTHY and not registry.ready()
    clock.now += 3600
    assert registry.available(Role.DECODE) == [], "time alone does not bring it back"
    worker.info = pb.NodeInfo(namespace_digest="ns")
    registry._set_state(worker, serving=True)  # what ``Registry.check`` does on a SERVING answer
    assert registry.available(Role.DECODE) == [worker] and worker.failures == 0
