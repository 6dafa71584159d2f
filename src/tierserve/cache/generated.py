"""Continuous offload of generated KV (docs/cache.md, continuous offload): a
request still running hands its full pages to the tree as they fill, which copies them to L2 and
on to L3 under the keys that continue its prompt's chain, while it keeps them
pinned. A later request whose prompt is this one's prompt plus the tokens generated so far (a
migration's re-prefill, a chat's next turn) hits them, in any tier, even if this node dies.

Every write policy: a checkpoint copies its path whatever the policy says of other nodes. Bounded:
with ``QUEUE_CAP`` copies (L1 -> L2 writes plus L3 backups) in flight, a checkpoint adds its pages to
the tree but starts no copy; the next checkpoint copies what is still missing on the path (the
release too, under ``write_through``). Nothing here waits: decoding never slows for a copy."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.base import PrefixHit
from tierserve.cache.loads import Loads
from tierserve.cache.radix_tree import RadixTree, path_pages

QUEUE_CAP = 64  # copies in flight beyond which a checkpoint copies nothing (its pages wait in L1)


Storable = Callable[[Sequence[int], list[int], str], int]  # (tokens, pages, salt) -> how many the tree may take


def checkpoint(tree: RadixTree, loads: Loads, allocator: PageAllocator, token_ids: Sequence[int], pages: list[int],
               num_computed: int, hit: PrefixHit, storable: Storable | None = None) -> PrefixHit | None:
    """Puts the full pages of ``token_ids[:num_computed]`` (held in ``pages``) in the tree and
    returns the hit that now lends them back, pinned, in place of ``hit`` (unpinned here); None
    when nothing changed (no new full page, a load under the hit not yet agreed landed, or a load of
    another request's still filling tree pages these would be swapped for). Pages the tree already
    held are swapped for the tree's (the hit's) and freed, so the caller's page table must become
    ``hit.pages + pages[len(hit.pages):]``. The caller then copies the new hit's path
    (``copy_now``). ``storable`` (a CP rank: ``cp_storable``) bounds the pages put in the tree as
    a release's are, so every path stays one rotation (``docs/cp.md``)."""
    ps = tree.page_size
    full = min(num_computed // ps, len(pages), loads.usable(pages))
    if storable is not None:
        full = min(full, storable(token_ids, pages[:full], hit.salt))
    if full <= len(hit.pages) or not all(load.landed for load in hit.loads):
        return None
    if tree.loading_under(token_ids[: full * ps], hit.salt):
        return None  # the tree's pages there may not hold their KV yet: keep computing on our own
    unused, node = tree.insert(token_ids[: full * ps], pages[:full], hit.salt)
    tree.lock(node)
    if hit.handle is not None:
        tree.unlock(hit.handle)
    loads.returned(hit)
    allocator.free(unused)  # this request's copies of pages the tree had: it reads the tree's now
    lent = PrefixHit(full * ps, path_pages(node), dict(hit.by_tier), handle=node, salt=hit.salt)
    loads.lent(lent)
    return lent


def copy_now(copies_in_flight: int) -> bool:
    """Whether a checkpoint starts the L1 -> L2 copies of every node on its path still without one,
    whatever the write policy (the point is that the pages outlive this node): not while
    ``QUEUE_CAP`` copies are in flight."""
    return copies_in_flight < QUEUE_CAP
