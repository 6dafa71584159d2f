"""Rank 0 starts ranks 1..N-1 of its node as child processes and watches them: one that dies takes
the node down at once (``docs/ranks.md``)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
from multiprocessing.process import BaseProcess

from tierserve.engine.commands import RankRole
from tierserve.engine.config import EngineConfig
from tierserve.engine.procs.failure_report import reported_failures
from tierserve.engine.procs.heartbeat import Heartbeats
from tierserve.engine.procs.ranks import Ranks, RankSpec, join, pick_device, rendezvous
from tierserve.engine.procs.worker import run_rank
from tierserve.engine.step_watch import StepWatch

log = logging.getLogger(__name__)
STOP_GRACE_S = 10.0  # how long stopped ranks may take to leave before they are killed


class RankProcesses:
    """The other ranks of a node and their watchdog. Start from the main thread (the children's
    parent-death signal is tied to the thread that started them) and ``stop`` in a ``finally``.
    ``role``: what a node role adds to each rank (``RankRole``), None for ``tierserve serve``."""

    def __init__(self, config: EngineConfig, log_level: str, role: RankRole | None = None) -> None:
        self.config, self.role = config, role
        self.store = rendezvous(config.num_ranks, config.dist_timeout_s)
        self.heartbeats = Heartbeats(mp.get_context(start_method(config.device)), config.num_ranks)
        self.children = [self._spawn(rank, log_level) for rank in range(1, config.num_ranks)]
        self._stopping = threading.Event()
        threading.Thread(target=self._watch, name="rank-watchdog", daemon=True).start()

    def join(self) -> Ranks:
        """Rank 0 joins the node's groups (waits for every rank, at most the timeout)."""
        return join(self._spec(0), self.config, self.store)

    def watch(self) -> StepWatch:
        """Rank 0's step watch over these ranks (their heartbeats tell a stopped rank from a slow one)."""
        return StepWatch(self.config.dist_timeout_s, stale=self.heartbeats.stale)

    def fail(self, reason: str) -> None:
        """Takes the node down: kills every other rank and exits this process with status 1. The
        message names what the failed ranks reported (``report_failure``)."""
        told = "".join(f"; {failure}" for failure in reported_failures(self.store, self.config.num_ranks))
        log.error("stopping the node: %s%s", reason, told)
        self._kill()
        logging.shutdown()
        os._exit(1)  # a thread blocked in a collective must not keep the process (and its port) alive

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """After rank 0 sent the stop message (or never will: ``grace_s`` 0): waits for the ranks to
        leave, then kills the rest."""
        self._stopping.set()
        for child in self.children:
            child.join(grace_s)
        self._kill()

    def _spec(self, rank: int) -> RankSpec:
        return RankSpec(rank, self.config.num_ranks, self.store.port, self.config.dist_timeout_s)

    def _spawn(self, rank: int, log_level: str) -> BaseProcess:
        args = (self._spec(rank), self.config, os.getpid(), log_level, self.heartbeats, self.role)
        context = mp.get_context(start_method(self.config.device))
        child = context.Process(target=run_rank, args=args, name=f"rank-{rank}", daemon=True)
        child.start()
        return child

    def _watch(self) -> None:
        """Waits for the children to end. Status 0 is a rank that left after the stop message (which
        may go out before ``stop`` is called); any other end, unless the node is stopping, is a dead rank."""
        watched = list(self.children)
        while watched:
            ended = multiprocessing.connection.wait([c.sentinel for c in watched])
            for child in [c for c in watched if c.sentinel in ended]:
                child.join()
                watched.remove(child)
                if child.exitcode != 0 and not self._stopping.is_set():
                    self.fail(f"{child.name} (pid {child.pid}) exited with {_describe(child.exitcode)}")

    def _kill(self) -> None:
        for child in self.children:
            if child.is_alive():
                child.kill()
        for child in self.children:
            child.join(5)


def _describe(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"signal {signal.Signals(-exitcode).name}"
    return f"status {exitcode}"


def start_method(device: str) -> str:
    """How rank 0 starts the other ranks. On CPU, ``fork``: a child starts with torch and tierserve
    already imported (a spawned one imports them again: ~3 s of CPU per rank, half of what the test
    suite's rank processes cost), safe because rank 0 has run no torch computation yet (its
    engine is built after the children start) and children never touch rank 0's objects. On
    CUDA, ``spawn``: a forked child cannot use CUDA once the parent touched it (vLLM's rule too)."""
    return "fork" if pick_device(device).type == "cpu" else "spawn"
