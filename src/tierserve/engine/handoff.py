"""The hook through which a request's KV leaves the engine while the model writes it."""

from __future__ import annotations

from typing import Any, Protocol


class Handoff(Protocol):
    """Receives a request's KV layer by layer (e.g. a transfer into a decode node's pages).

    Page ownership: while ``busy()`` the request's pages may still be read, so when the request
    ends the engine parks them and hands them back to the prefix cache only once it is False.
    """

    def on_layer(self, layer: int, pages: list[int], end: int) -> None:
        """Layer ``layer`` of tokens ``[0, end)`` is in the pool, in ``pages`` (the page table)."""
        ...

    def busy(self) -> bool:
        """Something may still read the request's pages."""
        ...


class SharedPlan(Protocol):
    """A handoff as picklable data, which crosses the ranks of a node in an ``AddRequest``: each
    rank builds its own ``Handoff`` from it (``RankRole.bind``; ``node/rank_transfer.py``'s
    ``HandoffPlan``). The engine only carries it: the destination's page table, the tokens the
    destination holds already and the prompt's length say which KV goes where."""

    @property
    def dst_pages(self) -> tuple[int, ...]: ...

    @property
    def dst_start(self) -> int: ...

    @property
    def prompt_len(self) -> int: ...


class HandoffCheckError(RuntimeError):
    """The KV a reservation received does not match what the prefill node sent (``KVCheck``)."""


class KVCheck(Protocol):
    """Checks the KV that arrived in a reservation's pages before the request runs (e.g. the
    handoff's digests, ``transfer/receive_check.py``): None when it is sound, else what is not.
    Called on every rank of the node, in the same order (it may run a collective)."""

    def __call__(self, engine: Any, request: Any) -> str | None: ...
