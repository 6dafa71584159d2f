"""What a prefill node's servicer holds of one request's KV handoff (``docs/pd.md``)."""

from __future__ import annotations

from typing import Protocol

from tierserve.engine.handoff import Handoff
from tierserve.transfer.handoff import HandoffResult


class SenderHandoff(Handoff, Protocol):
    """A request's sender: ``KVHandoff`` (one rank's), ``SidecarHandoff`` (a target's and a
    sidecar draft's pair) or ``AgreedHandoff`` (the whole node's, at several ranks).

    Contract: the engine calls ``on_layer`` as the model writes each layer and keeps the request's
    pages while ``busy()``. Any thread may then ``cancel`` (no more submissions; batches in flight
    still end before ``busy()`` turns False), wait for the ``result`` (up to ``timeout`` seconds; a
    timeout cancels) or for every batch to end (``wait_stopped``: True only when no block can land
    any more, never after a failed batch). ``peer_failed``: the transfer failed or hung on the
    destination's side; ``target``: the destination, for messages."""

    target: str

    @property
    def peer_failed(self) -> bool: ...

    def cancel(self, reason: str) -> None: ...

    def result(self, timeout: float) -> HandoffResult: ...

    def wait_stopped(self, timeout: float) -> bool: ...
