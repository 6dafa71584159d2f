"""Rank 0's per-step watchdog (``docs/ranks.md``, a frozen rank): a loop turn (the step broadcast and the
step, whose collectives wait for every rank) that runs past its bound makes the node report unhealthy on
its health endpoints until the turn ends. The bound of a turn is derived from its expected time:

    min(max(STEP_FLOOR_S, STEP_FACTOR x expected(the tokens its step scheduled)), dist_timeout / 2)

from the last HISTORY turns that stepped. Each recent turn of m tokens that took t seconds predicts a turn
of n tokens: t x n / m, except that a small turn (under LARGE_STEP_TOKENS) is never scaled down (its time is
mostly fixed cost). Only turns of at least 1/SCALE_SPAN of min(n, the largest recent turn) predict, and
``expected(n)`` is the slowest of their predictions once the slowest eighth is set aside (OUTLIER_SHARE).

The floor keeps a slow CPU step, or a machine's hiccup, from being called a freeze; scaling by the step's
tokens lets a long prefill chunk after a run of short decode steps take its time (a bound learnt from step
times alone flagged every such chunk, and never learnt from them). The span keeps a much smaller turn's
fixed cost from being scaled by a long turn's tokens: a slow small turn scaled by a long prefill chunk's
tokens put that chunk's bound at the cap (a frozen rank of a loaded prefill node went unreported for the
whole freeze, benchmarks/RELIABILITY.md). Setting the slowest eighth aside keeps one hiccup from setting
the bound for the next HISTORY turns: one 1-token turn of 2 s on a loaded machine, scaled to a 16-token
chunk, put the bound at the cap and a frozen CP rank went unreported (issue 31). Small turns are not
scaled down: with batch sizes that vary and turn times that do not (an overloaded decode node), a
per-token rate learnt from the larger batches called the smaller ones freezes (as did a bound from the
slowest small turn alone: benchmarks/RELIABILITY.md). Half the ``--dist-timeout`` reports a frozen rank
before its collective times out and the node exits. A turn that ran past its bound is not learnt from: a
freeze must not lengthen the bound of the next one.

With the ranks' heartbeats (``engine/procs/heartbeat.py``), which every multi-rank node has: a rank not
stamping (stopped or gone) makes the bound the floor alone, and between turns makes the node unhealthy
too; while every rank stamps, the step is slow rather than frozen, and STEP_FACTOR is LIVE_FACTOR times
larger (healthy nodes of an overloaded machine called their slow steps freezes, and the router had no node
of their role: benchmarks/RELIABILITY.md).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)
STEP_FLOOR_S = 3.0  # never overdue sooner: a tiny model's CPU step on a loaded machine stays well inside
STEP_FACTOR = 4.0
HISTORY = 32
LARGE_STEP_TOKENS = 64  # a turn of at least this many tokens measures the per-token cost, not the fixed one
LIVE_FACTOR = 4.0  # every rank's heartbeat fresh: the step is slow, not frozen (a loaded CPU), so wait longer
SCALE_SPAN = 4  # a turn predicts turns of up to this many times its tokens: beyond, its fixed cost would be scaled
OUTLIER_SHARE = 8  # the slowest eighth of the predictions is set aside (rounded: from 4 turns, one)


def _one() -> int:
    return 1


def _none() -> list[int]:
    return []


def _predicted(n: int, took: float, tokens: int) -> float:
    """What a turn of ``n`` tokens that took ``took`` seconds predicts for one of ``tokens``: scaled by
    tokens, but a small turn (mostly fixed cost) never down."""
    scale = tokens / n
    return took * (max(scale, 1.0) if n < LARGE_STEP_TOKENS else scale)


def _high(predictions: list[float]) -> float:
    """The slowest prediction once the slowest eighth (a loaded machine's hiccups) is set aside; 0 if none."""
    if not predictions:
        return 0.0
    ordered = sorted(predictions)
    return ordered[len(ordered) - 1 - (len(ordered) + OUTLIER_SHARE // 2) // OUTLIER_SHARE]


class StepWatch:
    """The engine thread opens a ``span`` around each loop turn; any thread asks ``overdue``. Reads
    and writes are of single attributes (atomic under the GIL): no lock."""

    def __init__(self, dist_timeout_s: float, floor_s: float = STEP_FLOOR_S,
                 clock: Callable[[], float] = time.monotonic, stale: Callable[[], list[int]] | None = None) -> None:
        self.floor_s, self.cap_s, self.clock = floor_s, dist_timeout_s / 2, clock
        self._stale = stale or _none  # the ranks not running at all (``Heartbeats.stale``; None: not known)
        self._factor = STEP_FACTOR * (LIVE_FACTOR if stale is not None else 1.0)
        self._turns: deque[tuple[int, float]] = deque(maxlen=HISTORY)  # (tokens, seconds) of recent turns
        self._work: Callable[[], int] = _one
        self._started: float | None = None
        self._reported = False
        self._idle_reported = False

    @property
    def bound_s(self) -> float:
        """How long the current turn may run before the node reports unhealthy (the rule above): the
        floor alone while a rank is not running at all (its heartbeat is stale)."""
        if self._stale():
            return self.floor_s
        return min(max(self.floor_s, self._factor * self._expected(max(1, self._work()))), self.cap_s)

    def _expected(self, tokens: int) -> float:
        """A turn of ``tokens`` tokens takes about this long, from the recent turns (the rule above)."""
        reach = min(tokens, max((n for n, _ in self._turns), default=0))
        return _high([_predicted(n, took, tokens) for n, took in self._turns if n * SCALE_SPAN >= reach])

    @contextmanager
    def span(self, learn: bool, work: Callable[[], int] = _one) -> Iterator[None]:
        """Watches the block; ``learn``: its time per token, when within its bound, lengthens later
        bounds. ``work``: the tokens the turn's step scheduled (read from any thread: the last step's
        until this one has scheduled)."""
        self._work, started = work, self.clock()
        self._started = started
        try:
            yield
        finally:
            self._started = None
            self._ended(self.clock() - started, learn)

    def overdue(self) -> bool:
        """The node cannot serve now (any thread): the turn running has run past its bound, or, between
        turns, a rank is not running (the next request would stall on it). Logged once per turn or gap."""
        started = self._started
        if started is None:
            return self._stale_between_turns()
        if self.clock() - started <= self.bound_s:
            return False
        if not self._reported:
            self._reported = True
            stale = self._stale()
            why = f"ranks {stale} not running: no heartbeat" if stale else \
                "a rank frozen or a collective stuck"
            log.error("rank 0's step has run %.1f s, past its bound of %.1f s (%s): the node reports unhealthy "
                      "until it ends", self.clock() - started, self.bound_s, why)
        return True

    def _stale_between_turns(self) -> bool:
        stale = self._stale()
        if bool(stale) is not self._idle_reported:
            self._idle_reported = bool(stale)
            if stale:
                log.error("ranks %s not running (no heartbeat) between steps: the node reports unhealthy until "
                          "they go on", stale)
            else:
                log.warning("every rank runs again: healthy again")
        return bool(stale)

    def _ended(self, took: float, learn: bool) -> None:
        bound = self.bound_s
        if took > bound or self._reported:  # a rank stopped and went on: its bound is long again, the time no step's
            log.warning("rank 0's step ended after %.1f s, past its bound: healthy again", took)
        elif learn:
            self._turns.append((max(1, self._work()), took))
        self._reported = False
