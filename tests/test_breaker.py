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


def _registry(failures: int = 3, open_s: float = 10.0, spare: bool = True) -> tuple[Registry, Worker]:
    """A registry with a healthy decode worker under test and, with ``spare``, a second one (the
    breaker never ejects the last available worker of a role); no channels: the breaker never
    calls them."""
    registry = Registry(breaker=BreakerOptions(failures=failures, open_s=open_s))
    worker = Worker(Role.DECODE, "127.0.0.1:1", channel=None, state=WorkerState.HEALTHY)
    others = [Worker(Role.DECODE, "127.0.0.1:2", channel=None, state=WorkerState.HEALTHY)] if spare else []
    for w in (worker, *others):
        registry.workers[(w.role, w.address)] = w
    return registry, worker


def test_the_defaults_are_the_documented_three_failures_and_ten_seconds() -> None:
    assert (BreakerOptions().failures, BreakerOptions().open_s) == (3, 10.0)


def test_failures_in_a_row_open_the_breaker_for_open_s_then_it_closes(clock: Clock) -> None:
    registry, worker = _registry(failures=3, open_s=10.0)
    for _ in range(2):
        registry.failed(worker, "UNAVAILABLE")
    assert worker in registry.available(Role.DECODE), "two failures do not open it"
    registry.failed(worker, "UNAVAILABLE")
    assert worker not in registry.available(Role.DECODE) and not worker.available
    assert worker.state is WorkerState.HEALTHY and worker.reason == "UNAVAILABLE"  # open, not unhealthy
    clock.now += 9.9
    assert not worker.available, "still open before open_s"
    clock.now += 0.1
    assert worker in registry.available(Role.DECODE), "closed once open_s passed"


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
    assert worker not in registry.available(Role.DECODE), "time alone does not bring it back"
    worker.info = pb.NodeInfo(namespace_digest="ns")
    registry._set_state(worker, serving=True)  # what ``Registry.check`` does on a SERVING answer
    assert worker in registry.available(Role.DECODE) and worker.failures == 0


def test_the_last_available_worker_of_a_role_is_never_ejected(clock: Clock) -> None:
    """With one decode node, an open breaker turns a slow or flaky node into an outage (503 "no
    healthy decode worker" for open_s): the trace replay got 6 of them from transfer timeouts under
    load. Like a load balancer's maximum ejection share, the breaker keeps the last one in."""
    registry, worker = _registry(failures=2, spare=False)
    for _ in range(5):
        registry.failed(worker, "ABORTED")
    assert registry.available(Role.DECODE) == [worker]
    two, first = _registry(failures=2)
    second = two.workers[(Role.DECODE, "127.0.0.1:2")]
    for _ in range(2):
        two.failed(first, "ABORTED")
    assert two.available(Role.DECODE) == [second], "the first one is ejected: another remains"
    for _ in range(3):
        two.failed(second, "ABORTED")
    assert two.available(Role.DECODE) == [second], "the second is now the last: it stays"


def test_an_unreachable_worker_is_out_even_when_it_is_the_last(clock: Clock) -> None:
    registry, worker = _registry(spare=False)
    registry.failed(worker, "UNAVAILABLE", unreachable=True)
    assert registry.available(Role.DECODE) == []
