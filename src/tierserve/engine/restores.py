"""A step's waits on the L2 -> L1 restores its batch reads, and the verdict every rank shares on
them (docs/cache.md, "Loads overlap compute layer by layer"; docs/ranks.md, "Multi-rank agreement").

The forward waits for each restore layer by layer, at any rank count, so layer l+1 copies while
layer l computes. A restore may fail, or hang, on one rank only, learnt mid-forward; leaving the
forward there would leave the other ranks in its collectives (TP all-reduces, PP sends, CP
gathers). So a wait never raises: the rank records the failure and computes on (garbage, for the
requests lent that copy only: attention reads each sequence's own pages, and every other step of
the forward is row-wise), and after the forward the ranks agree on which restores failed anywhere.
"""

from __future__ import annotations

import contextlib
import time

from tierserve.cache.loads import HostLoadError, LayerwiseLoad
from tierserve.cache.sharded.agreement import Agreement, agreed_all
from tierserve.engine.request import Request
from tierserve.engine.scheduler import Scheduled

# of the node's dist timeout: a rank waiting for its restores in a step leaves the other ranks in one
# of the forward's collectives, so its waits end well before those collectives give up
WAIT_SHARE = 0.5


class StepRestores:
    """The restores (``LayerwiseLoad``) a step's batch reads that the ranks have not yet agreed
    landed: the same list on every rank, since loads start in ``match`` and land on agreed values.

    Contract: the step's layer hooks call ``before_attention(l)`` before layer l's attention (which
    reads those pages); every rank then calls ``failed`` once, after the forward. All the step's
    waits together end by ``deadline`` (a ``time.monotonic()`` value; None: no bound); a copy not
    there by then is given up (``LayerwiseLoad.give_up``), which fails it like a copy error.
    """

    def __init__(self, loads: list[LayerwiseLoad], deadline: float | None = None) -> None:
        self.loads = loads
        self.deadline = deadline

    @classmethod
    def of(cls, batch: list[Scheduled], timeout_s: float | None = None) -> StepRestores:
        """``batch``'s restores not yet landed, its waits bounded by ``timeout_s`` from now."""
        loads = dict.fromkeys(x for s in batch for x in s.request.hit.loads if not x.landed)
        return cls(list(loads), None if timeout_s is None else time.monotonic() + timeout_s)

    def before_attention(self, layer_id: int) -> None:
        """Waits until layer ``layer_id`` of every restore is in the pool, failed, or given up."""
        for load in self.loads:
            self._wait(load, layer_id)

    def failed(self, agreement: Agreement) -> set[LayerwiseLoad]:
        """Waits (bounded) for the rest of each restore (layers no attention waited for, e.g. a
        packed draft's), then agrees: the restores that failed or were given up on any rank. No
        collective when the step has no restore (the same on every rank)."""
        if not self.loads:
            return set()
        for load in self.loads:
            self._wait(load, -1)
        agreed = agreed_all(agreement, [not load.failed for load in self.loads])
        return {load for load, ok in zip(self.loads, agreed, strict=True) if not ok}

    def _wait(self, load: LayerwiseLoad, layer_id: int) -> None:
        left = None if self.deadline is None else self.deadline - time.monotonic()
        with contextlib.suppress(HostLoadError):  # ``load.failed`` records it; ``failed`` judges it with the others
            load.wait(layer_id, left)


def lent_failed(batch: list[Scheduled], failed: set[LayerwiseLoad]) -> list[Request]:
    """The requests of ``batch`` lent pages of a ``failed`` restore: their step computed on garbage."""
    return [s.request for s in batch if any(load in failed for load in s.request.hit.loads)]
