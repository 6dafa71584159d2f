"""Context parallelism's sharded KV pages (``docs/cp.md``).

Every rank of a CP node keeps the same radix tree and the same *logical* page ids; a logical page
is stored by one rank only, its owner. Owner and local slot follow from the id alone (no per-page
table): ``owner = page % size``, ``local = page // size``. A sequence's pages rotate over the owners
(its page j belongs to ``(start + j) % size``), so a long prompt spreads evenly over the ranks and
its new pages continue the rotation of the cached prefix it extends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tierserve.cache.allocator import PageAccountingError, PageAllocator, disown


@dataclass(frozen=True)
class PageOwnership:
    """Which logical pages this CP rank (``rank`` of ``size``) stores, and where."""

    rank: int = 0
    size: int = 1

    def owner(self, page: int) -> int:
        return page % self.size

    def local(self, page: int) -> int:
        """The page's slot in its owner's pool."""
        return page // self.size

    def logical(self, owner: int, local: int) -> int:
        return local * self.size + owner

    def owns(self, page: int) -> bool:
        return self.owner(page) == self.rank

    def follows(self, anchor: int, pages: Sequence[int]) -> int:
        """How many leading ``pages`` continue the rotation of ``anchor``, the page just before them
        in the sequence (the first owned by the next owner, and so on)."""
        n = 0
        while n < len(pages) and self.owner(pages[n]) == (self.owner(anchor) + 1 + n) % self.size:
            n += 1
        return n

    def storable(self, tree_path: Sequence[int], pages: Sequence[int], on_device: int | None = None) -> int:
        """How many leading ``pages`` of a sequence the tree may keep, given the pages the tree holds
        along the sequence's path (``tree_path``: each node's device pages, or its host pages where
        it has none; a page's copies share its owner) of which the first ``on_device`` (default: all)
        are device pages. At those the tree keeps its own; at the host-only ones the tree would take
        the sequence's pages, so they must have the host pages' owners; past the path they must
        continue its rotation (the sequence's own first page's where the path is empty). The first
        page that breaks this would mix two rotations on one path: it and the rest are refused."""
        on_device = len(tree_path) if on_device is None else on_device
        shared = min(len(tree_path), len(pages))
        for i in range(on_device, shared):
            if self.owner(pages[i]) != self.owner(tree_path[i]):
                return i
        if len(pages) <= len(tree_path):
            return len(pages)
        if not tree_path:
            return 1 + self.follows(pages[0], pages[1:])
        return len(tree_path) + self.follows(tree_path[-1], pages[len(tree_path):])


class ShardedPageAllocator:
    """Logical page ids ``[0, local_pages * size)`` over per-owner free lists; the same interface as
    ``PageAllocator``. Deterministic (every rank holds the same one and must hand out the same ids).

    ``alloc_after(previous, n)`` continues the rotation of ``previous`` (a sequence's pages so far);
    a sequence without pages starts at the next owner in turn, so short sequences spread over the
    owners too. All-or-nothing: None when one of the owners needed lacks free pages.
    """

    def __init__(self, ownership: PageOwnership, local_pages: int) -> None:
        if local_pages <= 0:
            raise ValueError("the KV pool needs at least one page per rank")
        self.ownership = ownership
        self.num_pages = local_pages * ownership.size
        # one stack per owner, low local slots first, as PageAllocator hands out low pages first
        self._free = [[ownership.logical(o, s) for s in range(local_pages - 1, -1, -1)] for o in range(ownership.size)]
        self._in_use = bytearray(self.num_pages)
        self._next_start = 0

    @property
    def num_free(self) -> int:
        return sum(len(stack) for stack in self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def alloc(self, n: int) -> list[int] | None:
        return self.alloc_after((), n)

    def alloc_after(self, previous: Sequence[int], n: int) -> list[int] | None:
        if n <= 0:
            return []
        size = self.ownership.size
        start = self.ownership.owner(previous[-1]) + 1 if previous else self._next_start
        pages = self.alloc_owners([(start + j) % size for j in range(n)])
        if pages is not None and not previous:
            self._next_start = (self._next_start + 1) % size
        return pages

    def alloc_owners(self, owners: Sequence[int]) -> list[int] | None:
        """One page of each of ``owners``, in order; None (nothing taken) when one of them lacks
        free pages. A copy between tiers asks for the owners of its source pages, so that every
        page moves within its owner rank."""
        if any(owners.count(o) > len(self._free[o]) for o in set(owners)):
            return None
        pages = [self._free[o].pop() for o in owners]
        for p in pages:
            self._in_use[p] = 1
        return pages

    def num_used_by(self, owner: int) -> int:
        """Pages of ``owner`` in use: what that rank's own pool holds."""
        return self.num_pages // self.ownership.size - len(self._free[owner])

    def free(self, pages: Iterable[int]) -> None:
        for p in reversed(disown(self._in_use, pages)):  # so that allocating them again gives the same order
            self._free[self.ownership.owner(p)].append(p)

    def check(self) -> None:
        """Raises unless the free lists and the ownership flags describe the same set of pages."""
        listed = [p for stack in self._free for p in stack]
        if len(set(listed)) != len(listed):
            raise PageAccountingError("a page is on a free list twice")
        if any(self.ownership.owner(p) != o for o, stack in enumerate(self._free) for p in stack):
            raise PageAccountingError("a page is on another owner's free list")
        flagged = {p for p in range(self.num_pages) if not self._in_use[p]}
        if set(listed) != flagged:
            raise PageAccountingError(f"free lists and ownership disagree on {sorted(set(listed) ^ flagged)[:8]}")


def alloc_like(allocator: PageAllocator | ShardedPageAllocator, pages: Sequence[int]) -> list[int] | None:
    """As many pages as ``pages``, each with the owner of its counterpart there (any pages at CP 1)."""
    if isinstance(allocator, ShardedPageAllocator):
        return allocator.alloc_owners([allocator.ownership.owner(p) for p in pages])
    return allocator.alloc(len(pages))


def alloc_continuing(allocator: PageAllocator | ShardedPageAllocator, previous: Sequence[int],
                     n: int) -> list[int] | None:
    """``n`` pages continuing the rotation of ``previous`` (any pages at CP 1)."""
    if isinstance(allocator, ShardedPageAllocator):
        return allocator.alloc_after(previous, n)
    return allocator.alloc(n)


def until_fits(alloc: Callable[[], list[int] | None], evict: Callable[[], int]) -> list[int] | None:
    """``alloc()``, calling ``evict()`` between tries until it succeeds or evicts nothing. Under CP
    one owner may lack pages while others have free ones, so evicting the shortfall once may not do."""
    pages = alloc()
    while pages is None and evict():
        pages = alloc()
    return pages


def page_allocator(ownership: PageOwnership, local_pages: int) -> PageAllocator | ShardedPageAllocator:
    """The allocator of a rank whose pool holds ``local_pages``: sharded under CP, plain otherwise."""
    return PageAllocator(local_pages) if ownership.size == 1 else ShardedPageAllocator(ownership, local_pages)
