"""What an EAGLE head predicts: its drafts at each step, recorded beside the accepted counts (a
feature that changes only drafts verification refuses anyway changes no count, yet the drafts)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tierserve.engine.spec.drafts import Drafted
from tierserve.engine.spec.eagle import EagleDrafter


@contextmanager
def recorded_drafts(key: Callable[[str], int] = int) -> Iterator[dict[int, list[list[int]]]]:
    """While open, every EAGLE head's drafts in this process (each engine's), step by step, by
    ``key`` of the request id."""
    drafts: dict[int, list[list[int]]] = {}
    propose = EagleDrafter.propose

    def recorded(self: EagleDrafter, batch: list, hooks: object) -> dict[str, Drafted]:
        out = propose(self, batch, hooks)  # type: ignore[arg-type]
        for rid, drafted in out.items():
            drafts.setdefault(key(rid), []).append(drafted.tokens)
        return out

    EagleDrafter.propose = recorded  # type: ignore[method-assign]
    try:
        yield drafts
    finally:
        EagleDrafter.propose = propose  # type: ignore[method-assign]
