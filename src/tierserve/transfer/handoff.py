"""One request's KV handoff from a prefill node into a decode node's reserved pages.

The engine calls ``on_layer`` right after the model wrote a layer's K and V, so a layer's
transfer runs while the next layers compute. Submissions happen on the engine thread (they only
queue work in the transfer engine); a waiter thread per handoff collects completions, so a slow or
frozen peer delays only its own request. The request's pages must not be reused while ``busy()``.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass

from tierserve.transfer.engine import TransferEngineHandle, TransferError
from tierserve.transfer.layout import KVArena, layer_blocks, token_runs

_DONE = -1  # sentinel in the waiter's queue: no more batches


@dataclass
class HandoffResult:
    """Outcome of a handoff: ``error`` is None on success."""

    error: str | None
    bytes: int
    transfer_seconds: float  # first submission to last completion
    exposed_seconds: float  # last submission (the compute's end) to last completion


class KVHandoff:
    """Sends tokens ``[dst_start, prompt_len)`` of every layer from ``src`` pages into ``dst`` pages
    at ``target``. ``fault_rate`` makes that share of handoffs fail for real (one block aimed at an
    address the peer never registered), for fault tests."""

    def __init__(self, engine: TransferEngineHandle, target: str, src: KVArena, dst: KVArena,
                 dst_pages: list[int], dst_start: int, prompt_len: int, fault_rate: float = 0.0) -> None:
        self.engine, self.target, self.src, self.dst = engine, target, src, dst
        self.dst_pages, self.prompt_len = dst_pages, prompt_len
        self._sent = [dst_start] * src.num_layers  # per layer: tokens before this are submitted
        self._inject = fault_rate > 0 and random.random() < fault_rate
        self._batches: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._finished = threading.Event()
        self._error: str | None = None
        self._bytes = 0
        self._first_submit = self._last_submit = self._last_done = 0.0
        self._waiter = threading.Thread(target=self._wait_all, name="kv-handoff", daemon=True)
        self._waiter.start()
        if all(s >= prompt_len for s in self._sent):
            self._close_submissions()

    # -- engine thread ---------------------------------------------------------------------------

    def on_layer(self, layer: int, pages: list[int], end: int) -> None:
        """Layer ``layer`` of tokens up to ``end`` is in the source pool, in ``pages``."""
        start, end = self._sent[layer], min(end, self.prompt_len)
        if end <= start:
            return
        self._sent[layer] = end
        if self._error is None:
            self._submit(layer_blocks(self.src, self.dst, token_runs(pages, self.dst_pages, start, end,
                                                                     self.src.page_size), layer))
        if layer == self.src.num_layers - 1 and end == self.prompt_len:
            self._close_submissions()

    def busy(self) -> bool:
        """Transfers may still read the source pages."""
        return not self._finished.is_set()

    def cancel(self, reason: str) -> None:
        """Stops submitting (the request was aborted or its deadline passed); what is in flight
        still completes or fails inside the transfer engine before ``busy()`` turns False."""
        self._fail(reason)
        self._close_submissions()

    # -- any thread ------------------------------------------------------------------------------

    def result(self, timeout: float) -> HandoffResult:
        """Waits up to ``timeout`` seconds for every layer to arrive; a timeout cancels the handoff."""
        if not self._finished.wait(timeout):
            self.cancel(f"KV handoff to {self.target} did not complete within {timeout:.1f} s")
        return HandoffResult(
            self._error, self._bytes,
            max(0.0, self._last_done - self._first_submit), max(0.0, self._last_done - self._last_submit),
        )

    def _submit(self, blocks: list) -> None:
        if self._inject:
            self._inject = False
            blocks = [(blocks[0][0], 64, blocks[0][2]), *blocks[1:]]  # an unregistered address: fails at once
        now = time.monotonic()
        self._first_submit = self._first_submit or now
        self._last_submit = now
        try:
            batch = self.engine.submit(self.target, blocks)
        except TransferError as exc:
            self._fail(str(exc))
            return
        self._bytes += sum(b[2] for b in blocks)
        self._batches.put(batch)

    def _close_submissions(self) -> None:
        self._batches.put(_DONE)

    def _fail(self, reason: str) -> None:
        if self._error is None:
            self._error = reason

    def _wait_all(self) -> None:
        while (batch := self._batches.get()) != _DONE:
            ok = self.engine.wait(batch)
            self._last_done = time.monotonic()
            if not ok:
                self._fail(f"KV transfer to {self.target} failed (peer gone, refused or timed out)")
        self._last_done = self._last_done or time.monotonic()
        if self._error is None and any(s < self.prompt_len for s in self._sent):
            self._error = "KV handoff stopped before the whole prompt was sent"
        self._finished.set()
