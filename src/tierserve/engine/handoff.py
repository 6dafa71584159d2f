"""The hook through which a request's KV leaves the engine while the model writes it."""

from __future__ import annotations

from typing import Protocol


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
