"""Ranks' heartbeats (``engine/procs/heartbeat.py``, ``docs/ranks.md``, a frozen rank): a stopped rank
process goes stale within ``STALE_S`` and fresh again when it goes on; rank 0's step watch then bounds
the turn by the floor alone, and waits ``LIVE_FACTOR`` times longer while every rank is alive (a slow
step on a loaded machine, not a frozen rank)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
from helpers.clock import ManualClock
from helpers.polling import wait_for

from tierserve.engine.procs.heartbeat import BEAT_S, STALE_S, Heartbeats
from tierserve.engine.step_watch import LIVE_FACTOR, STEP_FACTOR, STEP_FLOOR_S, StepWatch


def _beat_until_killed(heartbeats: Heartbeats, rank: int) -> None:
    heartbeats.beat(rank)
    signal.pause()


@pytest.mark.parametrize("method", ["fork", "spawn"])  # how CPU and CUDA ranks start (engine/procs/spawn.py)
def test_a_stopped_rank_process_goes_stale_and_fresh_again_when_it_goes_on(method: str) -> None:
    context = mp.get_context(method)
    heartbeats = Heartbeats(context, 3)
    ranks = [context.Process(target=_beat_until_killed, args=(heartbeats, rank), daemon=True) for rank in (1, 2)]
    for rank in ranks:
        rank.start()
    try:
        wait_for(lambda: heartbeats.stale() == [], "both ranks beating", 10, interval_s=BEAT_S)
        os.kill(ranks[1].pid, signal.SIGSTOP)
        wait_for(lambda: heartbeats.stale() == [2], "rank 2 stale once stopped", STALE_S + 10, interval_s=BEAT_S)
        os.kill(ranks[1].pid, signal.SIGCONT)
        wait_for(lambda: heartbeats.stale() == [], "rank 2 fresh once it goes on", 10, interval_s=BEAT_S)
    finally:
        for rank in ranks:
            rank.kill()
            rank.join(10)


def test_a_slot_not_stamped_for_longer_than_stale_s_is_stale_and_rank_0s_is_never() -> None:
    clock = ManualClock(100.0)
    heartbeats = Heartbeats(mp.get_context("fork"), 2, clock=clock)
    clock.now += STALE_S
    assert heartbeats.stale() == []
    clock.now += 0.01
    assert heartbeats.stale() == [1]  # slot 0 (rank 0's) is as old, and unused


def _slow_history(watch: StepWatch, clock: ManualClock) -> None:
    for _ in range(3):  # decode turns of 2 s: a loaded machine
        with watch.span(learn=True):
            clock.now += 2.0


def test_a_stale_rank_bounds_the_turn_by_the_floor_and_fresh_ones_by_live_factor_times_the_rule() -> None:
    clock, stale = ManualClock(100.0), []
    watch = StepWatch(dist_timeout_s=600, clock=clock, stale=lambda: stale)
    unknown = StepWatch(dist_timeout_s=600, clock=clock)
    _slow_history(watch, clock)
    _slow_history(unknown, clock)
    assert unknown.bound_s == STEP_FACTOR * 2.0
    assert watch.bound_s == LIVE_FACTOR * STEP_FACTOR * 2.0  # every rank alive: slow, not frozen
    stale.append(1)
    assert watch.bound_s == STEP_FLOOR_S


def test_a_turn_with_a_stopped_rank_is_overdue_after_the_floor_and_not_learnt_after_it_goes_on() -> None:
    clock, stale = ManualClock(100.0), []
    watch = StepWatch(dist_timeout_s=600, clock=clock, stale=lambda: stale)
    _slow_history(watch, clock)
    before = watch.bound_s
    with watch.span(learn=True):
        stale.append(1)  # rank 1 stopped during the turn
        clock.now += STEP_FLOOR_S + 0.1
        assert watch.overdue()
        stale.clear()  # it went on: the turn ends within the long bound, but it was a freeze
        clock.now += 20.0
    assert watch.bound_s == before


def test_a_stopped_rank_between_turns_makes_the_node_unhealthy_until_it_goes_on() -> None:
    stale: list[int] = []
    watch = StepWatch(dist_timeout_s=600, clock=ManualClock(100.0), stale=lambda: stale)
    assert not watch.overdue()
    stale.append(1)
    assert watch.overdue() and watch.overdue()  # the next request would stall on it
    stale.clear()
    assert not watch.overdue()
