"""Ranks 1..N-1 tell rank 0 they are alive: each runs a thread that stamps its slot of a shared array
with the machine's monotonic clock every ``BEAT_S``; rank 0's step watch reads the stamps
(``docs/ranks.md``, a frozen rank). A stamp older than ``STALE_S`` is a rank that is not running at all
(stopped, or its process gone); a rank slowed by a loaded machine, or waiting in a collective, still
stamps, since the thread needs the CPU for microseconds and no lock the rank's work holds for long
(torch's kernels and collectives release the GIL)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from multiprocessing.context import BaseContext

BEAT_S = 0.2
STALE_S = 2.0  # ten missed beats: no scheduler delay of a runnable thread comes near it, a SIGSTOP does


class Heartbeats:
    """One slot per rank of a node, in memory shared with the rank processes (made by rank 0 before
    it starts them, handed to each as an argument). Rank 0's own slot is unused: a frozen rank 0 answers
    no health check at all."""

    def __init__(self, context: BaseContext, num_ranks: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # 8-byte stores and loads of aligned doubles: no lock needed for one writer per slot
        self._stamps = context.Array("d", [clock()] * num_ranks, lock=False)

    def beat(self, rank: int) -> None:
        """Stamps ``rank``'s slot now and every ``BEAT_S`` from a daemon thread, for the process's life."""
        self._stamps[rank] = self.clock()
        threading.Thread(target=self._beat, args=(rank,), name="rank-heartbeat", daemon=True).start()

    def stale(self) -> list[int]:
        """The ranks (1..N-1) whose last stamp is older than ``STALE_S``."""
        now = self.clock()
        return [rank for rank in range(1, len(self._stamps)) if now - self._stamps[rank] > STALE_S]

    def _beat(self, rank: int) -> None:
        while True:
            time.sleep(BEAT_S)
            self._stamps[rank] = self.clock()
