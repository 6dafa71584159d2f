"""KV handoffs of a prefill node of several ranks (``docs/ranks.md``): each rank sends
its own KV heads; the ranks agree, once per step, on whether every rank's sender finished, so every
rank gives a request's pages back at the same step, and rank 0 answers with the whole node's result.

Why an agreement: a request's pages stay parked while its handoff is ``busy()``; each rank's sender
ends at its own time, and a rank that unparked earlier than another would leave them with different
free lists. ``HandoffBoard.agree`` runs at the start of every step (``Engine.before_step``) on every
rank, in the same place: one ``all_gather`` of every live handoff's ``HandoffState`` (none while no
handoff lives, which every rank knows alike, since handoffs join in commands and leave on agreed
values). ``busy()`` reads only the agreed value, so it may be called between steps too.
"""

from __future__ import annotations

import threading
from dataclasses import astuple, dataclass, fields, replace

import torch
import torch.distributed as dist

from tierserve.engine.commands import AddRequest
from tierserve.engine.engine import Engine
from tierserve.engine.procs.ranks import Ranks
from tierserve.engine.request import RequestOutput
from tierserve.transfer.digest import MASK
from tierserve.transfer.handoff import HandoffResult, HandoffState, KVHandoff
from tierserve.transfer.sidecar import SidecarHandoff

_STATE_FIELDS = len(fields(HandoffState))  # a row's first values; then its digests, if any


class HandoffBoard:
    """This rank's live handoffs, in the order they joined (the same on every rank)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.live: list[AgreedHandoff] = []

    def agree(self) -> None:
        """Every rank, at the start of every step: one collective when handoffs live."""
        if not self.live:
            return
        local = torch.tensor([h.row() for h in self.live], dtype=torch.int64)
        gathered = [torch.empty_like(local) for _ in range(self.ranks.size)]
        dist.all_gather(gathered, local, group=self.ranks.control)
        states = torch.stack(gathered, dim=1)  # [handoff, rank, field]
        for handoff, rows in zip(self.live, states.tolist(), strict=True):
            handoff.settle([HandoffState(*(int(v) for v in row[:_STATE_FIELDS])) for row in rows],
                           [row[_STATE_FIELDS:] for row in rows])
        self.live = [h for h in self.live if h.busy()]


class AgreedHandoff:
    """One rank's side of a request's handoff: ``local`` sends this rank's heads (and its sidecar
    draft pool's, if any: a ``SidecarHandoff``); ``busy`` is the
    agreed value. Rank 0's servicer uses ``cancel`` (reaches the other ranks at the next
    agreement), ``result``, ``wait_stopped`` and ``peer_failed`` for the whole node."""

    def __init__(self, local: KVHandoff | SidecarHandoff, board: HandoffBoard) -> None:
        self.local, self.board = local, board
        self.target = local.target
        self._agreed = threading.Event()  # every rank's sender finished
        self._states: list[HandoffState] = []
        self._digests: list[int] = []  # every rank's added up, per model layer (``--handoff-integrity``)
        self._timed_out_peer = False

    # -- engine thread ---------------------------------------------------------------------------

    def on_layer(self, layer: int, pages: list[int], end: int) -> None:
        self.local.on_layer(layer, pages, end)

    def busy(self) -> bool:
        """Some rank's sender may still read the request's pages (agreed; any thread)."""
        return not self._agreed.is_set()

    def row(self) -> list[int]:
        """What this rank contributes to the agreement: its state, then its digests (if any)."""
        state = self.local.state()  # read first: a finished state comes with final digests
        return [*astuple(state), *self.local.digest_row()]

    def settle(self, states: list[HandoffState], digests: list[list[int]]) -> None:
        """The agreed states and digest rows, one per rank: a rank that failed or was cancelled stops the others."""
        if any(s.failed for s in states) and not self.local.state().failed:
            self.local.cancel("another rank of this node stopped its KV handoff")
        self._states = states
        if all(s.finished for s in states):
            self._digests = [sum(column) & MASK for column in zip(*digests, strict=True)]
            self._agreed.set()

    # -- rank 0's servicer -------------------------------------------------------------------------

    @property
    def peer_failed(self) -> bool:
        return self._timed_out_peer or self.local.peer_failed or any(s.peer_failed for s in self._states)

    def cancel(self, reason: str) -> None:
        self.local.cancel(reason)

    def wait_stopped(self, timeout: float) -> bool:
        """True once every rank's batches ended and none failed (see ``KVHandoff.wait_stopped``)."""
        return self._agreed.wait(timeout) and not any(s.unsettled for s in self._states)

    def result(self, timeout: float) -> HandoffResult:
        """Waits up to ``timeout`` seconds for every rank; a timeout cancels the handoff everywhere."""
        if not self._agreed.wait(timeout):
            message = f"KV handoff to {self.target} did not complete within {timeout:.1f} s"
            self._timed_out_peer = self.local.all_submitted()
            self.cancel(message)
            return HandoffResult(message, 0, 0.0, 0.0)
        result = _combined(self._states, self.local.result(0).error)
        return replace(result, digests=self._digests if result.error is None else [])


def _combined(states: list[HandoffState], own_error: str | None) -> HandoffResult:
    """The node's result: bytes of every rank, the timings from the first submission to the last completion."""
    failed = [rank for rank, s in enumerate(states) if s.failed]
    error = own_error or (f"rank {failed[0]}'s KV handoff failed" if failed else None)
    starts = [s.first_submit_us for s in states if s.first_submit_us]
    done = max(s.last_done_us for s in states)
    transfer = (done - min(starts)) / 1e6 if starts else 0.0
    exposed = (done - max(s.last_submit_us for s in states)) / 1e6 if starts else 0.0
    return HandoffResult(error, sum(s.bytes for s in states), max(0.0, transfer), max(0.0, exposed))


@dataclass(frozen=True)
class HandoffAdd:
    """Adds a request whose KV every rank hands over: joins the board (every rank, the same
    command) then adds; a refused request leaves the board and stops its sender. The other ranks
    receive ``add`` (its plan, not this rank's handoff) and rebuild their own (``RankRole.bind``)."""

    add: AddRequest
    handoff: AgreedHandoff

    @property
    def request_id(self) -> str:
        return self.add.request_id

    def apply(self, engine: Engine) -> RequestOutput | None:
        board = self.handoff.board
        board.live.append(self.handoff)
        try:
            return replace(self.add, handoff=self.handoff).apply(engine)
        except BaseException:
            board.live.remove(self.handoff)
            self.handoff.local.cancel("the engine refused the request")
            raise

    def shared(self) -> AddRequest:
        return replace(self.add, handoff=None)
