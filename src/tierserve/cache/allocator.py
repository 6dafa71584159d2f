"""Free list of device KV pages with strict ownership checks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PageAccountingError(RuntimeError):
    """A page was freed twice, freed while free, or is out of range: a bug, never an expected state."""


def disown(in_use: bytearray, pages: Iterable[int]) -> list[int]:
    """``pages``, each cleared in the ownership flags ``in_use``; raises ``PageAccountingError`` at
    the first one out of range or not allocated (those before it stay cleared: a bug either way)."""
    pages = list(pages)
    for p in pages:
        if not 0 <= p < len(in_use) or not in_use[p]:
            raise PageAccountingError(f"page {p} freed but not allocated")
        in_use[p] = 0
    return pages


class PageAllocator:
    """Hands out page indices in ``[0, num_pages)``; every page is either free or owned by one caller.

    ``alloc`` is all-or-nothing: it returns exactly ``n`` pages or ``None`` and changes nothing.
    Freeing a page that is not allocated raises ``PageAccountingError``.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low pages are handed out first
        self._in_use = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        if n <= 0:
            return []
        pages = self._free[-n:][::-1]  # ascending: consecutive pages coalesce into one copy or transfer
        del self._free[-n:]
        for p in pages:
            self._in_use[p] = 1
        return pages

    def alloc_after(self, previous: Sequence[int], n: int) -> list[int] | None:
        """``alloc(n)`` for a sequence whose pages so far are ``previous``; here any pages do (a CP
        node's ``ShardedPageAllocator`` continues their owners' rotation)."""
        return self.alloc(n)

    def free(self, pages: Iterable[int]) -> None:
        self._free.extend(reversed(disown(self._in_use, pages)))  # so that allocating them again gives the same order

    def check(self) -> None:
        """Raises unless the free list and the ownership flags describe the same set of pages."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise PageAccountingError("a page is on the free list twice")
        flagged_free = {p for p in range(self.num_pages) if not self._in_use[p]}
        if free != flagged_free:
            raise PageAccountingError(f"free list and ownership disagree on {sorted(free ^ flagged_free)[:8]}")
