"""Ranks 1..N-1 of a node: each builds the same engine over its shard and applies what rank 0
broadcasts, step by step, until told to stop (``docs/ranks.md``)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
from dataclasses import dataclass

from tierserve.core.gc_heap import freeze_startup_heap
from tierserve.core.logs import configure_logging
from tierserve.core.test_hooks import lagging
from tierserve.engine.commands import Bind, EngineCall, EngineCommand, RankRole, runs_collectives
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.procs.failure_report import CommandMismatch, report_failure
from tierserve.engine.procs.heartbeat import Heartbeats
from tierserve.engine.procs.ranks import RankSpec, join, leave
from tierserve.engine.procs.step_bus import FollowerBus, StepMessage

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Outcome:
    """How a command went on this rank: ``error`` is what it raised (None: it went well)."""

    command: EngineCommand | EngineCall
    error: Exception | None


def follow(engine: Engine, bus: FollowerBus, bind: Bind = lambda command: command) -> None:
    """Applies rank 0's messages (each command through ``bind``, the role's) until the stop
    message. Outputs and errors are rank 0's to report: fed the same commands, this rank's engine
    produced the same ones. A command that fails here and not on rank 0, or the other way round,
    raises ``CommandMismatch`` naming it and the error (the rank then fails, and rank 0 stops the
    node with that message: ``report_failure``); a command published ahead of rank 0's outcome is
    compared when the next message brings it, before anything else of that message is applied."""
    unsettled: Outcome | None = None
    while not (message := bus.receive()).stop:
        unsettled = apply_message(engine, message, bind, unsettled)


def apply_message(engine: Engine, message: StepMessage, bind: Bind, unsettled: Outcome | None = None
                  ) -> Outcome | None:
    """One message of rank 0's: first the outcome it brings of the previous message's last command
    (``unsettled``, when that was published ahead), then its commands, in order, then its step if
    it has one. Returns this message's last command's outcome here when it was published ahead."""
    if unsettled is not None:
        _compare(unsettled, failed_on_leader=message.late)
    last = len(message.commands) - 1
    for index, command in enumerate(message.commands):
        outcome = _apply_one(engine, command, bind)
        if message.ahead and index == last:
            return _stepped(engine, message, outcome)
        _compare(outcome, failed_on_leader=index in message.failed)
    return _stepped(engine, message, None)


def _stepped(engine: Engine, message: StepMessage, unsettled: Outcome | None) -> Outcome | None:
    if message.step:
        engine.step(message.now)  # rank 0's clock: leases expire at the same step on every rank
        engine.take_failures()
    return unsettled


def _apply_one(engine: Engine, command: EngineCommand | EngineCall, bind: Bind) -> Outcome:
    try:
        bind(command).apply(engine)
    except Exception as exc:
        return Outcome(command, exc)
    return Outcome(command, None)


def _compare(outcome: Outcome, failed_on_leader: bool) -> None:
    """A command's outcome here must be rank 0's, except for a collective one, whose ranks agree on
    its outcome themselves (rank 0 published it before it knew its own)."""
    if runs_collectives(outcome.command) or (outcome.error is not None) == failed_on_leader:
        return  # the same error: rank 0 answered the request with it
    if outcome.error is not None:
        raise CommandMismatch(f"{_named(outcome.command)} failed on this rank, not on rank 0: "
                              f"{outcome.error!r}") from outcome.error
    raise CommandMismatch(f"{_named(outcome.command)} failed on rank 0, not on this rank")


def _named(command: EngineCommand | EngineCall) -> str:
    request_id = getattr(command, "request_id", None)
    return type(command).__name__ + (f" of request {request_id}" if request_id else "")


def run_rank(spec: RankSpec, config: EngineConfig, parent_pid: int, log_level: str, heartbeats: Heartbeats,
             role: RankRole | None = None) -> None:
    """A rank process's body (``multiprocessing`` spawn target). Exits non-zero on any failure, which
    rank 0's watchdog turns into the node's exit; dies with rank 0 (parent-death signal). A node
    role's ``role`` attaches to the engine before the first message (``RankRole``)."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; rank 0 stops us
    _log_as(spec.rank, log_level)
    heartbeats.beat(spec.rank)
    try:
        ranks = join(spec, config)
        engine = Engine(config, ranks=ranks)
        bind = lagging(role.attach(engine) if role is not None else (lambda command: command))  # lag: tests only
        freeze_startup_heap()  # as rank 0 does: a pass over this heap would stall the node's lockstep
        follow(engine, FollowerBus(ranks), bind)
        engine.cache.close()  # as rank 0 does: an L3 client left mounted would be given objects it cannot hold
        leave()
    except BaseException as exc:
        log.exception("rank %d failed; the node goes down", spec.rank)
        report_failure(spec, exc)  # rank 0 names it when it stops the node
        logging.shutdown()
        os._exit(1)  # no interpreter teardown: a collective in another thread must not hold us


def _die_with_parent(parent_pid: int) -> None:
    """Linux sends this process SIGKILL when rank 0 dies, even by SIGKILL; if rank 0 died before
    the signal was set, exit now."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: rank 0's watchdog still stops us
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def _log_as(rank: int, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s"))
    configure_logging(level, handlers=[handler])
