"""Context parallelism's page ownership: owner and slot from the logical id, the rotation the
allocator keeps, and the radix cache refusing an insertion that would mix two rotations."""

from __future__ import annotations

import pytest

from tierserve.cache.allocator import PageAccountingError
from tierserve.cache.base import PrefixHit
from tierserve.cache.radix_cache import RadixCache
from tierserve.cache.sharded.cp_pages import PageOwnership, ShardedPageAllocator

PAGE = 4


def test_owner_and_slot_follow_from_the_logical_id() -> None:
    own = PageOwnership(rank=1, size=3)
    assert [own.owner(p) for p in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [own.local(p) for p in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert all(own.logical(own.owner(p), own.local(p)) == p for p in range(30))
    assert [p for p in range(7) if own.owns(p)] == [1, 4]


def test_a_sequence_rotates_over_the_owners_and_extensions_continue_it() -> None:
    own = PageOwnership(0, 2)
    alloc = ShardedPageAllocator(own, local_pages=8)
    first = alloc.alloc_after([], 3)
    assert [own.owner(p) for p in first] == [0, 1, 0]
    more = alloc.alloc_after(first, 2)
    assert [own.owner(p) for p in more] == [1, 0]  # continues from the last page's owner
    fresh = alloc.alloc_after([], 1)
    assert [own.owner(p) for p in fresh] == [1]  # the next fresh sequence starts at the next owner
    alloc.check()


def test_alloc_is_all_or_nothing_per_owner() -> None:
    own = PageOwnership(0, 2)
    alloc = ShardedPageAllocator(own, local_pages=2)
    held = alloc.alloc_after([], 3)  # owners 0, 1, 0: owner 0 is now full
    assert alloc.num_free == 1
    assert alloc.alloc_after(held, 1) == [1 * 2 + 1]  # owner 1's last slot
    alloc.free(held[:1])
    assert alloc.alloc_after([1], 2) is None  # owner 0 has one page, not two: nothing taken
    assert alloc.num_free == 1
    with pytest.raises(PageAccountingError):
        alloc.free([held[0]])
    alloc.check()


def _cache() -> tuple[RadixCache, ShardedPageAllocator]:
    own = PageOwnership(0, 2)
    alloc = ShardedPageAllocator(own, local_pages=16)
    return RadixCache(alloc, PAGE, b"seed", own), alloc


def _store(cache: RadixCache, tokens: list[int], pages: list[int]) -> None:
    cache.release(tokens, pages, len(tokens), PrefixHit())


def test_an_extension_that_continues_the_rotation_is_stored() -> None:
    cache, alloc = _cache()
    prefix = list(range(8))
    pages = alloc.alloc_after([], 2)
    _store(cache, prefix, pages)
    hit = cache.match([*prefix, 50, 51, 52, 53, 54])
    assert hit.pages == pages
    more = alloc.alloc_after(hit.pages, 1)
    cache.release([*prefix, 50, 51, 52, 53], hit.pages + more, 12, hit)
    assert cache.match([*prefix, 50, 51, 52, 53, 9]).pages == pages + more
    assert cache.stats()["cp_refused_pages_total"] == 0
    alloc.check()


def test_an_insertion_mixing_rotations_is_refused_and_its_pages_freed() -> None:
    cache, alloc = _cache()
    prefix = list(range(8))
    a = alloc.alloc_after([], 2)  # rotation from owner 0
    b = alloc.alloc_after([], 3)  # the same prefix computed concurrently: rotation from owner 1
    assert [alloc.ownership.owner(p) for p in b] == [1, 0, 1]
    _store(cache, prefix, a)
    free_before = alloc.num_free
    _store(cache, [*prefix, 70, 71, 72, 73], b)
    # b's first two pages repeat the tree's (freed as duplicates); its third would follow a's page
    # of owner 1 with another page of owner 1: refused, freed, not cached.
    assert cache.stats()["cp_refused_pages_total"] == 1
    assert alloc.num_free == free_before + 3
    assert cache.match([*prefix, 70, 71, 72, 73, 5]).pages == a
    alloc.check()


def test_a_fresh_sequence_keeps_its_own_rotation() -> None:
    cache, alloc = _cache()
    alloc.alloc_after([], 1)  # another sequence took the first start
    pages = alloc.alloc_after([], 3)
    _store(cache, list(range(12)), pages)
    assert cache.match(list(range(13))).pages == pages
    assert cache.stats()["cp_refused_pages_total"] == 0


def test_storable_counts_the_tree_path_then_the_rotation() -> None:
    own = PageOwnership(0, 2)
    assert own.storable([], [0, 1, 2, 3]) == 4
    assert own.storable([], [1, 2, 4]) == 2  # owners 1, 0, 0: the third breaks the rotation
    assert own.storable([0, 1], [0, 1, 2, 3]) == 4
    assert own.storable([0, 1], [0, 1, 3, 4]) == 2  # after the path's owner 1 comes owner 0, not 1
    assert own.storable([0, 1, 2], [0, 1]) == 2
