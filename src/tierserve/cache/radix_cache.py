"""Device-tier (L1) prefix cache: the radix tree behind the engine's prefix-cache hook."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tierserve.cache import inflight
from tierserve.cache.allocator import PageAllocator
from tierserve.cache.base import PrefixHit, SingleTier, Snapshot
from tierserve.cache.events import KVEventListener
from tierserve.cache.radix_tree import RadixTree
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.core.scope import NO_SCOPE, CacheScope
from tierserve.core.tiers import CacheTier

if TYPE_CHECKING:
    from tierserve.cache.prefetch import PrefetchTicket


class RadixCache(SingleTier):
    """Keeps the KV pages of finished (and preempted) requests, shares them with later requests
    whose prompts start the same way, and frees least recently used ones when the pool runs short.

    Page ownership: a page is owned by exactly one of the allocator's free list, a request, or
    the tree. ``release`` moves a request's full computed pages into the tree (or frees them when
    the tree already has those tokens) and frees the rest.

    ``ownership``: a CP rank's (``cp_pages``). ``release`` then keeps only the pages that continue
    the rotation of the tree's path; the others are freed (counted in ``cp_refused_pages_total``)
    and a later request recomputes them rather than reading them from the wrong owner.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, seed: bytes,
                 ownership: PageOwnership | None = None) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.tree = RadixTree(page_size, seed)
        self.ownership = ownership or PageOwnership()
        self.num_cached_pages = 0
        self.evicted_pages = 0
        self.refused_pages = 0
        self.shared_pages = 0

    def match(self, token_ids: Sequence[int], ticket: PrefetchTicket | None = None,
              scope: CacheScope = NO_SCOPE) -> PrefixHit:
        salt = scope.salt
        found = self.tree.match(token_ids, salt)
        self.tree.lock(found.device_node)
        n = len(found.device_pages) * self.page_size
        return PrefixHit(n, list(found.device_pages), {CacheTier.DEVICE: n} if n else {}, handle=found.device_node,
                         salt=salt)

    def release(self, token_ids: Sequence[int], pages: list[int], num_computed: int, hit: PrefixHit) -> None:
        full = self._storable(token_ids, pages[: min(num_computed // self.page_size, len(pages))], hit.salt)
        unused, _ = self.tree.insert(token_ids[: full * self.page_size], pages[:full], hit.salt)
        self.num_cached_pages += full - len(hit.pages) - len(unused)
        self.allocator.free(unused + pages[full:])
        if hit.handle is not None:
            self.tree.unlock(hit.handle)

    shares_in_flight = True

    def share(self, token_ids: Sequence[int], pages: list[int], num_full: int, hit: PrefixHit) -> PrefixHit | None:
        num_full = cp_storable(self.tree, self.ownership, token_ids, pages[:num_full], hit.salt)
        lent = inflight.share(self.tree, token_ids, pages, num_full, hit)
        if lent is not None:
            self.shared_pages += len(lent.pages) - len(hit.pages)
            self.num_cached_pages += len(lent.pages) - len(hit.pages)  # tree pages, as a hit's are
        return lent

    def cached_prefix(self, token_ids: Sequence[int], scope: CacheScope = NO_SCOPE) -> int:
        return self.tree.cached_pages(token_ids, scope.salt)

    def _storable(self, token_ids: Sequence[int], pages: list[int], salt: str) -> int:
        """How many of ``pages`` the tree may take: all of them without CP."""
        keep = cp_storable(self.tree, self.ownership, token_ids, pages, salt)
        self.refused_pages += len(pages) - keep
        return keep

    def evict(self, num_pages: int) -> int:
        device, host = self.tree.evict_device(num_pages)
        if host:
            raise RuntimeError("the L1-only radix cache holds no host pages")
        self.allocator.free(device)
        self.num_cached_pages -= len(device)
        self.evicted_pages += len(device)
        return len(device)

    def stats(self) -> dict[str, float]:
        return {"device_evicted_pages_total": self.evicted_pages, "cp_refused_pages_total": self.refused_pages,
                "inflight_shared_pages_total": self.shared_pages}

    def on_step(self) -> None:
        pass

    def set_event_listener(self, listener: KVEventListener) -> bool:
        self.tree.listener = listener
        return True

    def snapshot(self) -> Snapshot:
        return self.tree.snapshot()


def cp_storable(tree: RadixTree, ownership: PageOwnership, token_ids: Sequence[int], pages: list[int],
                salt: str) -> int:
    """How many leading ``pages`` of a released sequence the tree may keep: all without CP, else
    those that do not bring a second rotation onto the tree's path (``PageOwnership.storable``):
    its host-only nodes included, which ``insert`` would give the sequence's device pages."""
    if ownership.size == 1:
        return len(pages)
    path, on_device = tree.copies_along(token_ids[: len(pages) * tree.page_size], salt)
    return ownership.storable(path, pages, on_device)
