"""A request's handoff when a speculative draft keeps its KV in its own (sidecar) pool
(``docs/speculative.md``, PD): two ``KVHandoff``s behind one face, the
target's pool into the destination's arena and the draft's pool into the destination's draft arena,
both from the request's page table into the same destination page table. The engine numbers the
draft's layer i as layer ``split + i`` (``DraftKV.hooks``, as for a packed draft), so ``on_layer``
splits there; the handoff is busy until both ended and fails when either fails."""

from __future__ import annotations

import time
from dataclasses import astuple

from tierserve.transfer.digest import MASK
from tierserve.transfer.handoff import HandoffResult, HandoffState, KVHandoff


class SidecarHandoff:
    """``target`` sends layers ``[0, split)``, ``draft`` the draft's layers (``split`` on); the
    rest of ``KVHandoff``'s contract holds for the pair."""

    def __init__(self, target: KVHandoff, draft: KVHandoff, split: int) -> None:
        self.parts, self.split = (target, draft), split
        self.target = target.target  # for messages, as ``KVHandoff.target``

    def on_layer(self, layer: int, pages: list[int], end: int) -> None:
        """Layer ``layer`` of the engine's numbering (the draft's after the target's) is written."""
        if layer < self.split:
            self.parts[0].on_layer(layer, pages, end)
        else:
            self.parts[1].on_layer(layer - self.split, pages, end)

    def busy(self) -> bool:
        return any(p.busy() for p in self.parts)

    def cancel(self, reason: str) -> None:
        """Stops the parts still sending (a part that ended keeps its own outcome)."""
        for part in self.parts:
            if part.busy():
                part.cancel(reason)

    def digest_row(self) -> list[int]:
        """Both parts' digests added up (``KVHandoff.digest_row``): each counts its own layers (the
        target's, then the draft's), zeros at the other's, so ``--handoff-integrity`` covers both."""
        return _added(*(p.digest_row() for p in self.parts))

    def all_submitted(self) -> bool:
        return all(p.all_submitted() for p in self.parts)

    @property
    def peer_failed(self) -> bool:
        return any(p.peer_failed for p in self.parts)

    def wait_stopped(self, timeout: float) -> bool:
        """True when no block of either part can land any more (``KVHandoff.wait_stopped``)."""
        deadline = time.monotonic() + timeout
        return all([p.wait_stopped(max(0.0, deadline - time.monotonic())) for p in self.parts])

    def result(self, timeout: float) -> HandoffResult:
        """Waits up to ``timeout`` seconds for both parts; one part's failure cancels the other."""
        deadline = time.monotonic() + timeout
        error, outcomes = None, []
        for part in self.parts:  # both waited for: a cancelled part still ends its batches
            outcomes.append(part.result(max(0.0, deadline - time.monotonic())))
            if error is None and outcomes[-1].error is not None:
                error = outcomes[-1].error
                self.cancel(error)
        state = self.state()
        started = state.first_submit_us or state.last_done_us
        return HandoffResult(error, state.bytes, max(0.0, (state.last_done_us - started) / 1e6),
                             max(0.0, (state.last_done_us - (state.last_submit_us or started)) / 1e6),
                             _added(*(o.digests for o in outcomes)) if error is None else [])

    def state(self) -> HandoffState:
        """Both parts as one (``finished`` only when both are; times from the first start to the last end)."""
        rows = [astuple(p.state()) for p in self.parts]
        flags = [any(row[i] for row in rows) for i in range(1, 4)]
        starts = [row[5] for row in rows if row[5]]
        return HandoffState(all(row[0] for row in rows), *flags, sum(row[4] for row in rows),
                            min(starts, default=0), max(row[6] for row in rows), max(row[7] for row in rows))


def _added(target: list[int], draft: list[int]) -> list[int]:
    """Two parts' digest rows summed per layer (mod 2^32); none without digests."""
    if not target or not draft:
        return target or draft
    return [(a + b) & MASK for a, b in zip(target, draft, strict=True)]
