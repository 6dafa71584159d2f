"""One request's KV handoff from a prefill rank into a decode node's reserved pages (of one or
several decode ranks: one ``Route`` each).

The engine calls ``on_layer`` right after the model wrote a layer's K and V, so a layer's
transfer runs while the next layers compute. On CUDA "wrote" means "queued the kernels": each
layer's blocks carry an event recorded then, and the sender waits for it before the transfer
engine reads the pages. The engine thread only computes the layer's blocks
and queues them: a sender thread per handoff submits and waits, because the transfer engine can
block in a call (e.g. the first handshake with a frozen peer), and that must delay only this
request. The request's pages must not be reused while ``busy()``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.transfer.digest import SendDigests
from tierserve.transfer.engine import EntryBudget, Link, Peers, TransferError
from tierserve.transfer.layout import Block, KVArena, Route, Run, held_pages, local_pages, route_blocks, token_runs
from tierserve.transfer.staging import Gatherer, Staged, gathers

_DONE = None  # sentinel in the sender's queue: no more layers
MAX_BATCH_ENTRIES = 1024  # blocks per transfer batch (see _parts)
STAGING_WAIT_S = 5.0  # a gather waits this long for staging room, then sends its blocks in place


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class _Gather:
    """Runs of one layer along a route that gathers (``staging.gathers``), with the staging and
    blocks when the engine thread gathered them already (else the sender gathers)."""

    route: Route
    runs: list[Run]
    layer: int
    staged: tuple[Staged, list[Block]] | None = None


_Batch = tuple[str, list[Block] | _Gather]  # (target, what to send) of one layer
_InFlight = tuple[str, int, int, Staged | None]  # (target, batch id, entries, staging it reads)


@dataclass
class HandoffResult:
    """Outcome of a handoff: ``error`` is None on success."""

    error: str | None
    bytes: int
    transfer_seconds: float  # first submission to last completion
    exposed_seconds: float  # last submission (the compute's end) to last completion
    digests: list[int] = field(default_factory=list)  # per model layer, then draft layer, with ``--handoff-integrity``


@dataclass(frozen=True)
class HandoffState:
    """One rank's handoff as the ranks of a node agree on it: flags, bytes sent, and the
    monotonic clock (microseconds, the same on every process of a machine) of its first and last
    submission and last completion (0: none yet)."""

    finished: bool
    failed: bool
    unsettled: bool
    peer_failed: bool
    bytes: int
    first_submit_us: int
    last_submit_us: int
    last_done_us: int


def _parts(blocks: list[Block]) -> list[list[Block]]:
    """A layer's blocks in batches that fit an engine's ``EntryBudget`` (``docs/mooncake.md``):
    head sub-ranges between TP sizes make one entry per token."""
    return [blocks[i:i + MAX_BATCH_ENTRIES] for i in range(0, len(blocks), MAX_BATCH_ENTRIES)]


def _pieces(runs: list[Run], max_tokens: int) -> list[list[Run]]:
    """``runs`` cut so no piece holds more than ``max_tokens`` tokens or ``MAX_BATCH_ENTRIES / 2`` runs."""
    pieces: list[list[Run]] = [[]]
    held = 0
    for s, d, n in runs:
        while n:
            if held == max_tokens or len(pieces[-1]) == MAX_BATCH_ENTRIES // 2:
                pieces.append([])
                held = 0
            take = min(n, max_tokens - held)
            pieces[-1].append((s, d, take))
            s, d, n, held = s + take, d + take, n - take, held + take
    return [p for p in pieces if p]


def _us(seconds: float) -> int:
    return round(seconds * 1e6)


class KVHandoff:
    """Sends tokens ``[dst_start, prompt_len)`` of every layer from ``src`` pages into ``dst_pages``
    along each of ``routes`` (one batch per route and layer; no routes: nothing to send, e.g. a
    rank whose KV head another rank sends); routes that gather go through ``gatherer``'s staging
    when one is given (``transfer/staging.py``). ``pages`` (``on_layer``) are logical: under context
    parallelism (``owner`` of size above 1) this rank sends only the pages it owns, each from its
    local slot, into the destination's page of the same position; the other CP ranks send the rest.
    A route into a CP decode rank carries only the pages that rank holds (``held_pages``).
    Batches go through ``engines`` (fault tests wrap it: ``transfer/faulty.py``). ``digests``: this
    rank's digests of what it sends."""

    def __init__(self, engines: Peers, routes: list[Route], src: KVArena, dst_pages: list[int],
                 dst_start: int, prompt_len: int, cuda: bool = False, gatherer: Gatherer | None = None,
                 owner: PageOwnership | None = None, digests: SendDigests | None = None) -> None:
        self.engines, self.routes, self.src, self.gatherer = engines, routes, src, gatherer
        self.owner, self.digests = owner, digests
        self.target = ",".join(dict.fromkeys(r.target for r in routes))  # for messages
        self.dst_pages, self.prompt_len = dst_pages, prompt_len
        start = dst_start if routes else prompt_len
        self._sent = [start] * src.num_layers  # per layer: tokens before this are submitted
        self._cuda = cuda  # the source pool is on CUDA: blocks wait for their layer's kernels
        self._layers: queue.SimpleQueue[tuple[Callable[[], None], list[_Batch]] | None] = queue.SimpleQueue()
        self._finished = threading.Event()
        self._error: str | None = None
        self._unsettled = False  # a batch failed: some of its blocks may still be on the wire
        self.peer_failed = False  # the transfer into ``target`` failed or hung: the peer's failure, not ours
        self._bytes = 0
        self._engines: dict[str, Link] = {}  # per target, acquired by the sender thread
        self._first_submit = self._last_submit = self._last_done = 0.0
        self._sender = threading.Thread(target=self._send_all, name="kv-handoff", daemon=True)
        self._sender.start()
        if all(s >= prompt_len for s in self._sent):
            self._close_submissions()

    # -- engine thread ---------------------------------------------------------------------------

    def on_layer(self, layer: int, pages: list[int], end: int) -> None:
        """Layer ``layer`` of tokens up to ``end`` is in the source pool, in ``pages``."""
        start, end = self._sent[layer], min(end, self.prompt_len)
        if end <= start:
            return
        self._sent[layer] = end
        if self.digests is not None:
            self._digest(layer, local_pages(self.owner, pages), start, end)
        if self._error is None:
            now = time.monotonic()
            self._first_submit = self._first_submit or now
            self._last_submit = now
            batches = [batch for r in self.routes if layer in r.layers  # the destination ranks holding it
                       for batch in self._batches(r, self._runs(r, pages, start, end), layer)]
            self._layers.put((self._written(), batches))
        if layer == self.src.num_layers - 1 and end == self.prompt_len:
            self._close_submissions()

    def busy(self) -> bool:
        """Transfers may still read the source pages (and write the destination's)."""
        return not self._finished.is_set()

    def wait_stopped(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for every batch to end; True when no block can land
        any more. Never True after a failed batch: Mooncake reports a batch failed as soon as one
        of its blocks failed, while its other blocks may still be writing into the peer, and it
        has no way to wait for them (``docs/faults.md``)."""
        return self._finished.wait(timeout) and not self._unsettled

    def cancel(self, reason: str) -> None:
        """Stops submitting (the request was aborted or its deadline passed); what is in flight
        still completes or fails inside the transfer engine before ``busy()`` turns False."""
        self._fail(reason)
        self._close_submissions()

    # -- any thread ------------------------------------------------------------------------------

    def result(self, timeout: float) -> HandoffResult:
        """Waits up to ``timeout`` seconds for every layer to arrive; a timeout cancels the handoff."""
        if not self._finished.wait(timeout):
            # every layer was submitted: only the peer's side was left (a peer frozen from the
            # start hangs the transfer past Mooncake's own timeouts)
            self.peer_failed = self.all_submitted()
            self.cancel(f"KV handoff to {self.target} did not complete within {timeout:.1f} s")
        return HandoffResult(
            self._error, self._bytes,
            max(0.0, self._last_done - self._first_submit), max(0.0, self._last_done - self._last_submit),
            self.digests.values() if self.digests is not None and self._error is None else [],
        )

    def state(self) -> HandoffState:
        """A snapshot for the other ranks of a node (any thread); ``finished`` is read first, so a
        finished snapshot holds final values."""
        finished = not self.busy()
        return HandoffState(finished, self._error is not None, self._unsettled, self.peer_failed, self._bytes,
                            _us(self._first_submit), _us(self._last_submit), _us(self._last_done))

    def digest_row(self) -> list[int]:
        """This rank's digests as int64 values for the node's agreement (``node/handoffs.py``): zeros
        until the sender finished, none without ``digests``."""
        if self.digests is None:
            return []
        return self.digests.sums.tolist() if self._finished.is_set() else [0] * len(self.digests.sums)

    def all_submitted(self) -> bool:
        """Every layer of the whole prompt was submitted: only the peers' side can be left."""
        return all(sent >= self.prompt_len for sent in self._sent)

    def _digest(self, layer: int, src: list[int] | list[int | None], start: int, end: int) -> None:
        """Adds what ``layer``'s routes take of tokens ``[start, end)`` to the digests: per
        destination CP owner, only the tokens of the pages it holds (so each token counts once per
        destination head, as the decode ranks' sums count it: ``docs/cp.md``)."""
        assert self.digests is not None
        by_owner: dict[PageOwnership, list[tuple[int, int]]] = {}
        for r in (r for r in self.routes if layer in r.layers):
            by_owner.setdefault(r.owner, []).append((r.src_offset, r.nbytes))
        for owner, spans in by_owner.items():
            held = src if owner.size == 1 else [s if owner.owns(d) else None
                                                for s, d in zip(src, self.dst_pages, strict=False)]
            self.digests.add(layer, spans, held, start, end, self.src.page_size)

    def _runs(self, route: Route, pages: list[int], start: int, end: int) -> list[Run]:
        """Tokens ``[start, end)`` as runs into the page table, or into staging indexed by token."""
        dst_pages = held_pages(route.owner, self.dst_pages, route.by_token)
        return token_runs(local_pages(self.owner, pages), dst_pages, start, end, self.src.page_size)

    def _batches(self, route: Route, runs: list[Run], layer: int) -> list[_Batch]:
        """What the sender sends of ``layer`` along ``route``: staged gathers, a quarter of the
        staging arena at most each, where the route gathers and a ``gatherer`` exists, else blocks."""
        if self.gatherer is not None and gathers(self.src, route):
            most = max(1, self.gatherer.staging.capacity // (8 * route.nbytes))
            return [(route.target, self._gather_now(route, piece, layer)) for piece in _pieces(runs, most)]
        return [(route.target, part) for part in _parts(route_blocks(self.src, route, runs, layer))]

    def _gather_now(self, route: Route, runs: list[Run], layer: int) -> _Gather:
        """Gathers on the engine thread, right after the layer's KV was written, when staging has
        room: the copy then overlaps the sender's transfer of the layer before (on CUDA it is queued
        before the layer's event, so the sender's wait covers it); else the sender gathers."""
        assert self.gatherer is not None
        return _Gather(route, runs, layer, self.gatherer.stage(route, runs, layer, 0.0, sync=False))

    def _written(self) -> Callable[[], None]:
        """Engine thread: what the sender calls to wait until the kernels queued so far ran."""
        if not self._cuda:
            return _nothing
        event = torch.cuda.Event()
        event.record()
        return event.synchronize

    def _close_submissions(self) -> None:
        self._layers.put(_DONE)

    def _fail(self, reason: str) -> None:
        if self._error is None:
            self._error = reason

    def _send_all(self) -> None:
        """Submits layers as they come and waits for the oldest batch whenever none is queued."""
        inflight: list[_InFlight] = []
        while (item := self._layers.get()) is not _DONE:
            written, batches = item
            if self._error is None:
                written()
                self._submit_all(batches, inflight)
            else:
                self._discard(batches)
            while inflight and self._layers.empty():
                self._wait(*inflight.pop(0))
        self._drain(inflight)
        for target in self._engines:
            self.engines.release(target)
        self._last_done = self._last_done or time.monotonic()
        if self._error is None and any(s < self.prompt_len for s in self._sent):
            self._error = "KV handoff stopped before the whole prompt was sent"
        self._finished.set()

    def _submit_all(self, batches: list[_Batch], inflight: list[_InFlight]) -> None:
        """Submits a layer's batches within each engine's ``EntryBudget``. Before waiting for room
        it waits for its own batches, which gives their entries back: a sender that waited while
        holding some could wait on another that waits on it."""
        for i, (target, what) in enumerate(batches):
            budget = self._budget(target) if self._error is None else None
            if budget is None:  # failed or cancelled meanwhile: send no more
                self._discard(batches[i:])
                return
            for blocks, staged in self._resolved(what, inflight):
                if not budget.take(len(blocks), block=False):
                    self._drain(inflight)
                    budget.take(len(blocks), block=True)
                batch = self._submit(target, blocks)
                if batch is None:
                    budget.give(len(blocks))
                    self._unstage(staged)
                else:
                    inflight.append((target, batch, len(blocks), staged))

    def _resolved(self, what: list[Block] | _Gather, inflight: list[_InFlight]
                  ) -> list[tuple[list[Block], Staged | None]]:
        """Blocks to submit, with the staging they read. A gather that finds no room first waits for
        this handoff's own batches (giving their staging back), then for others' up to
        ``STAGING_WAIT_S``; after that its runs go in place, one block per token (slow, but correct)."""
        if not isinstance(what, _Gather):
            return [(what, None)]
        if what.staged is not None:
            return [(what.staged[1], what.staged[0])]
        assert self.gatherer is not None
        staged = self.gatherer.stage(what.route, what.runs, what.layer, 0.0)
        if staged is None:
            self._drain(inflight)
            staged = self.gatherer.stage(what.route, what.runs, what.layer, STAGING_WAIT_S)
        if staged is None:
            return [(part, None) for part in _parts(route_blocks(self.src, what.route, what.runs, what.layer))]
        return [(staged[1], staged[0])]

    def _discard(self, batches: list[_Batch]) -> None:
        """Gives back the staging of batches that will not be sent (the handoff failed)."""
        for _, what in batches:
            if isinstance(what, _Gather) and what.staged is not None:
                self._unstage(what.staged[0])

    def _unstage(self, staged: Staged | None) -> None:
        if staged is not None and self.gatherer is not None:
            self.gatherer.staging.free(staged.offset, staged.nbytes)

    def _budget(self, target: str) -> EntryBudget | None:
        """The engine to ``target`` (started on first use) and its budget; None if it cannot start."""
        try:
            if target not in self._engines:
                self._engines[target] = self.engines.acquire(target)
        except TransferError as exc:
            self.peer_failed = True
            self._fail(str(exc))
            return None
        return self.engines.budget(target)

    def _submit(self, target: str, blocks: list[Block]) -> int | None:
        try:
            batch = self._engines[target].submit(target, blocks)
        except TransferError as exc:
            self.peer_failed = True
            self._fail(str(exc))
            return None
        self._bytes += sum(b[2] for b in blocks)
        return batch

    def _drain(self, inflight: list[_InFlight]) -> None:
        while inflight:
            self._wait(*inflight.pop(0))

    def _wait(self, target: str, batch: int, entries: int, staged: Staged | None) -> None:
        ok = self._engines[target].wait(batch)
        self.engines.budget(target).give(entries)
        self._unstage(staged)  # even after a failure: blocks still in flight only read it
        self._last_done = time.monotonic()
        if not ok:
            self._unsettled = self.peer_failed = True
            self._fail(f"KV transfer to {target} failed (peer gone, refused or timed out)")
