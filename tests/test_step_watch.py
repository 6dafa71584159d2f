"""Rank 0's per-step watchdog (``engine/step_watch.py``, ``docs/ranks.md``): a loop turn that waits for
the other ranks past its bound makes ``/health`` and ``/readiness`` answer 503, and a node's gRPC health
NOT_SERVING, until it ends; the bound
follows the rule documented there. Background work with nothing to schedule backs off (``engine/loop.py``).
Unit tests, one process: a bus whose broadcast blocks stands for a frozen rank (``tests/test_tp_faults.py``
freezes a real one)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from grpc_health.v1 import health, health_pb2
from helpers.clock import ManualClock
from helpers.polling import wait_for

from tierserve.api.engine_backend import create_engine_app
from tierserve.core.sampling import SamplingParams
from tierserve.engine.commands import EngineCall, EngineCommand
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.loop import IDLE_POLL_MAX_S, PEER_POLL_S, EngineLoop
from tierserve.engine.step_watch import HISTORY, LARGE_STEP_TOKENS, STEP_FACTOR, STEP_FLOOR_S, StepWatch
from tierserve.node.server import _follow_engine


def test_the_bound_is_the_floor_then_a_multiple_of_the_slowest_recent_step_capped_by_the_dist_timeout() -> None:
    clock = ManualClock(100.0)
    watch = StepWatch(dist_timeout_s=120, clock=clock)
    assert watch.bound_s == STEP_FLOOR_S  # nothing learnt: the floor
    for took in (0.5, 2.0, 1.0):
        with watch.span(learn=True):
            clock.now += took
    assert watch.bound_s == STEP_FACTOR * 2.0
    for _ in range(HISTORY):  # the slow step leaves the window
        with watch.span(learn=True):
            clock.now += 0.01
    assert watch.bound_s == STEP_FLOOR_S
    assert StepWatch(dist_timeout_s=4, clock=clock).bound_s == 2.0  # reported before the collective times out


def test_a_turn_is_overdue_only_past_its_bound_and_an_overdue_one_is_not_learnt() -> None:
    clock = ManualClock(100.0)
    watch = StepWatch(dist_timeout_s=120, clock=clock)
    assert not watch.overdue()  # no turn running
    with watch.span(learn=True):
        clock.now += STEP_FLOOR_S
        assert not watch.overdue()
        clock.now += 0.1
        assert watch.overdue()
    assert not watch.overdue()
    assert watch.bound_s == STEP_FLOOR_S  # the frozen turn did not lengthen the next bound
    with watch.span(learn=False):
        clock.now += 1.0
    assert watch.bound_s == STEP_FLOOR_S  # a turn without a step (a keepalive) teaches nothing


class FreezableBus:
    """A ``StepBus`` of several ranks whose broadcast blocks while ``frozen`` is clear, as rank 0's
    collectives do when a rank is stopped."""

    idle_wait: float | None = 0.05

    def __init__(self) -> None:
        self.thawed = threading.Event()
        self.thawed.set()
        self.blocked = threading.Event()

    def record(self, command: EngineCommand | EngineCall) -> None:
        pass

    def failed(self) -> None:
        pass

    def publish(self, step: bool, now: float) -> None:
        if step and not self.thawed.is_set():
            self.blocked.set()
            self.thawed.wait(60)

    def stop(self) -> None:
        self.thawed.set()

    def lost(self, error: BaseException) -> None:
        raise AssertionError(f"lost: {error!r}")


def _generate(loop: EngineLoop, tokens: list[int]) -> None:
    async def run() -> None:
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        async for out in loop.generate("frozen", [5, 6, 7], params):
            tokens.extend(out.new_token_ids)

    asyncio.run(run())


def test_a_frozen_step_makes_the_node_unhealthy_until_it_ends(tiny_llama: Path) -> None:
    bus = FreezableBus()
    engine = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=16, max_total_tokens=512))
    loop = EngineLoop(engine, bus, StepWatch(dist_timeout_s=120, floor_s=0.3)).start()
    tokens: list[int] = []
    try:
        with TestClient(create_engine_app(loop, None, "tiny")) as client:
            assert client.get("/health").status_code == 200
            bus.thawed.clear()
            request = threading.Thread(target=_generate, args=(loop, tokens))
            request.start()
            assert bus.blocked.wait(30), "the request's step never reached the bus"
            wait_for(lambda: client.get("/health").status_code == 503, "/health 503 while the step is frozen", 10)
            assert client.get("/readiness").status_code == 503
            bus.thawed.set()
            wait_for(lambda: client.get("/health").status_code == 200, "/health 200 once the step ended", 10)
            request.join(30)
    finally:
        bus.thawed.set()
        loop.stop()
    assert len(tokens) == 20  # the frozen request completed


class ToggledLoop:
    healthy = True


async def _health_status(servicer: health.aio.HealthServicer) -> int:
    reply = await servicer.Check(health_pb2.HealthCheckRequest(service=""), None)
    return reply.status


def test_grpc_health_follows_the_engines_health() -> None:
    """A prefill or decode node's gRPC health (what the router checks) says what ``/health`` says."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def run() -> list[int]:
        loop, servicer, seen = ToggledLoop(), health.aio.HealthServicer(), []
        await servicer.set("", serving)
        follow = asyncio.create_task(_follow_engine(loop, servicer, ("",)))  # type: ignore[arg-type]
        for healthy, expected in ((False, not_serving), (True, serving)):
            loop.healthy = healthy
            for _ in range(200):  # up to 10 s
                if await _health_status(servicer) == expected:
                    break
                await asyncio.sleep(0.05)  # poll interval
            seen.append(await _health_status(servicer))
        follow.cancel()
        return seen

    assert asyncio.run(run()) == [not_serving, serving]


class CountingBus(FreezableBus):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def publish(self, step: bool, now: float) -> None:
        self.steps += step


def test_background_work_with_nothing_to_schedule_backs_off_instead_of_stepping_every_few_ms(tiny_llama: Path) -> None:
    """A stuck L3 read keeps the cache busy with no batch to run: the loop's turns (at several ranks a
    broadcast and a collective each) thin out to one per ``IDLE_POLL_MAX_S``, not one per 5 ms."""
    bus = CountingBus()
    bus.idle_wait = 1.0
    engine = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=16, max_total_tokens=512))
    engine.has_work = lambda: True  # type: ignore[method-assign]  # background work that never ends
    loop = EngineLoop(engine, bus).start()
    try:
        wait_for(lambda: bus.steps >= 6, "the loop backs off to its longest wait", 10, interval_s=0.001)
        first, started = bus.steps, time.monotonic()
        wait_for(lambda: bus.steps >= first + 10, "ten more steps", 10, interval_s=0.001)
        took = time.monotonic() - started
    finally:
        loop.stop()
    assert took >= 8 * IDLE_POLL_MAX_S, f"10 empty steps in {took:.3f} s"  # 5 ms apart: 0.05 s


def test_a_rank_waiting_for_the_others_l3_work_polls_without_backing_off(tiny_llama: Path) -> None:
    """Rank 0 finished its probe or read of a prefetch and the others have not (``awaits_peers``):
    their L3 lanes cannot wake its loop, so it polls every ``PEER_POLL_S`` instead of backing off
    to ``IDLE_POLL_MAX_S`` (issue 28: a CP=2 node's read from L3 lost up to 50 ms at the probe and
    at the end of the read); once it no longer waits for them, it backs off again."""
    engine = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=16, max_total_tokens=512))
    engine.has_work = lambda: True  # type: ignore[method-assign]  # background work, nothing to schedule
    loop = EngineLoop(engine, CountingBus())  # not started: its waits are asked for directly
    engine.cache.awaits_peers = True  # type: ignore[misc]
    assert [loop._wait() for _ in range(6)] == [PEER_POLL_S] * 6
    engine.cache.awaits_peers = False  # type: ignore[misc]
    assert [loop._wait() for _ in range(6)][-1] == IDLE_POLL_MAX_S


def test_a_long_step_that_scheduled_more_tokens_is_within_its_bound_and_learnt() -> None:
    """After decode steps of one token (0.5 s each), a 100-token prefill chunk taking 10 s is what its
    tokens lead to expect, not a freeze: within its bound, and learnt."""
    clock = ManualClock(100.0)
    watch = StepWatch(dist_timeout_s=120, clock=clock)
    for _ in range(3):
        with watch.span(learn=True, work=lambda: 1):
            clock.now += 0.5
    assert watch.bound_s == STEP_FLOOR_S  # 4 x 0.5 s for one token is under the floor
    with watch.span(learn=True, work=lambda: 100):
        clock.now += 10.0
        assert not watch.overdue()
    with watch.span(learn=True, work=lambda: 1):
        clock.now += 1.0
        assert not watch.overdue()
        clock.now += STEP_FLOOR_S
        assert watch.overdue(), "a one-token step is still bounded by the floor"


def test_a_long_step_of_a_loaded_prefill_node_is_bounded_by_its_large_steps_not_scaled_small_ones() -> None:
    """Prefill chunks of 1,000 tokens take 1 s (1 ms a token); one slow 1-token turn (0.5 s: mostly fixed
    cost, a loaded machine) must not scale into the next chunk's bound (0.5 s x 1,000 tokens: the cap, 60 s,
    so a frozen rank went unreported for a whole 20 s freeze in the reliability campaign)."""
    clock = ManualClock(100.0)
    watch = StepWatch(dist_timeout_s=120, clock=clock)
    for tokens, took in ((1000, 1.0), (1000, 1.0), (1, 0.5)):
        with watch.span(learn=True, work=lambda tokens=tokens: tokens):
            clock.now += took
    with watch.span(learn=False, work=lambda: 1000):
        assert watch.bound_s == STEP_FACTOR * 1.0  # 1,000 tokens at the large turns' 1 ms a token
        clock.now += STEP_FACTOR * 1.0 + 0.1
        assert watch.overdue(), "a frozen rank is reported within a few of its steps' times"
    with watch.span(learn=False, work=lambda: 4):  # a small turn: the small turns within its span, scaled up
        assert watch.bound_s == STEP_FACTOR * 4 * 0.5
    assert LARGE_STEP_TOKENS > 4


def _learn(watch: StepWatch, clock: ManualClock, turns: list[tuple[int, float]]) -> None:
    """Turns of (tokens, seconds), each within its bound and learnt."""
    for tokens, took in turns:
        with watch.span(learn=True, work=lambda tokens=tokens: tokens):
            clock.now += took
            assert not watch.overdue(), (tokens, took)


def test_a_loaded_machines_hiccups_do_not_set_the_bound_of_the_turns_after() -> None:
    """Issue 31: a CP 2 prefill node (16-token chunks of 0.3 s) had one 1-token turn take 2 s (the machine
    was loaded); scaled to a 16-token chunk (x 16 x STEP_FACTOR) it put the bound at the cap, and a frozen
    rank was not reported within 5 s. A chunk that hit a hiccup is set aside as well."""
    clock = ManualClock(100.0)
    watch = StepWatch(dist_timeout_s=120, clock=clock)
    _learn(watch, clock, [(16, 0.3)] * 14 + [(1, 2.0), (8, 0.25)] + [(16, 0.3)] * 14 + [(16, 2.0), (1, 0.1)])
    with watch.span(learn=False, work=lambda: 16):
        assert watch.bound_s == STEP_FLOOR_S  # was the cap, 60 s
        clock.now += STEP_FLOOR_S + 0.1
        assert watch.overdue(), "a frozen rank is reported within the floor"
    with watch.span(learn=False, work=lambda: 1):
        assert watch.bound_s == STEP_FLOOR_S


def test_a_loaded_decode_nodes_uniformly_slow_turns_are_not_called_freezes() -> None:
    """Decode batches of 1 to 8 sequences that all take 3.5 s (an overloaded machine: the time is fixed
    cost) stay within their bounds whatever the batch, even 2x slower still: a per-token rate learnt from
    the larger batches would bound a 1-sequence batch by 4 x 3.5 s / 8, under the floor. Batches whose
    time grows with their tokens (long contexts) bound a batch larger than any recent one by that rate."""
    clock = ManualClock(100.0)
    watch = StepWatch(dist_timeout_s=120, clock=clock)
    sizes = [1 + (i * 5) % 8 for i in range(HISTORY)]
    _learn(watch, clock, [(size, 2.5) for size in sizes] + [(size, 3.5) for size in sizes])  # the load grows
    _learn(watch, clock, [(size, 7.0) for size in range(1, 9)])
    watch = StepWatch(dist_timeout_s=120, clock=clock)
    _learn(watch, clock, [(size, 0.2 * size) for size in (10, 14, 20, 12, 16, 18) * 4])
    with watch.span(learn=False, work=lambda: 24):
        assert watch.bound_s == pytest.approx(STEP_FACTOR * 0.2 * 24)
