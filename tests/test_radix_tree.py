"""Radix tree and the L1 radix cache: matching, splitting, pins, eviction, page ownership."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.hashing import page_keys
from tierserve.cache.radix_cache import RadixCache
from tierserve.cache.radix_tree import RadixTree
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

SEED = b"s" * 32


def test_match_splits_and_returns_device_prefix() -> None:
    tree = RadixTree(2, SEED)
    tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    m = tree.match([1, 2, 3, 4, 9, 9])
    assert m.device_pages == [10, 11] and m.host_pages == []
    assert m.last_node.tokens == (1, 2, 3, 4)  # the node was split after two pages
    assert [c.tokens for c in m.last_node.children.values()] == [(5, 6)]
    assert tree.match([1, 2, 3, 4, 5, 6, 7]).device_pages == [10, 11, 12]
    assert tree.match([1, 2, 3]).device_pages == [10]  # only whole pages match
    assert tree.match([2, 2]).device_pages == []


def test_insert_reports_pages_it_did_not_take_and_keys_chain() -> None:
    tree = RadixTree(2, SEED)
    tree.insert([1, 2, 3, 4], [10, 11])
    unused, node = tree.insert([1, 2, 3, 4, 5, 6], [20, 11, 12])
    assert unused == [20]  # 11 is the tree's own page, 20 a duplicate of page 10
    assert node.device == [12]
    assert node.keys == page_keys(SEED, [1, 2, 3, 4, 5, 6], 2)[2:]


def test_lru_eviction_respects_pins_and_keeps_host_copies() -> None:
    tree = RadixTree(1, SEED)
    tree.insert([1, 2], [10, 11])
    tree.insert([3, 4], [12, 13])
    pinned = tree.match([1, 2]).last_node
    tree.lock(pinned)
    device, host = tree.evict_device(10)
    assert sorted(device) == [12, 13] and host == []
    tree.unlock(pinned)
    node = tree.match([1]).last_node
    node.host = [7]
    device, _ = tree.evict_device(10)
    assert sorted(device) == [10, 11]
    m = tree.match([1, 2])
    assert m.device_pages == [] and m.host_pages == [7]  # the node stayed, host-only
    assert tree.evict_host(5) == [7] and not tree.root.children


def _start_request(machine, tokens: list[int]) -> None:
    """Matches ``tokens`` (waiting for any host load), then takes pages for the rest plus one, as
    the engine does; a request that gets no pages gives its hit back at once."""
    hit = machine.cache.match(tokens)
    for load in hit.loads:
        load.wait(0)
    pages = machine.alloc.alloc(len(tokens) // 2 - len(hit.pages) + 1)
    if pages is None:
        machine.cache.release(tokens, list(hit.pages), hit.num_tokens, hit)
        return
    machine.held.append((tokens, hit.pages + pages, hit))


def _finish_request(machine, data) -> list[int]:
    """Releases one held request, drawn by ``data`` (a machine's ``finish`` rule): its tokens."""
    tokens, pages, hit = machine.held.pop(data.draw(st.integers(0, len(machine.held) - 1)))
    machine.cache.release(tokens, pages, len(tokens), hit)
    return tokens


class TreeMachine(RuleBasedStateMachine):
    """Random insert/match/lock/evict sequences against a reference: the set of cached prefixes."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(64)
        self.cache = RadixCache(self.alloc, 2, SEED)
        self.reference: dict[tuple[int, ...], int] = {}  # cached token prefix -> its last page
        self.held: list = []

    tokens = st.lists(st.integers(0, 3), min_size=0, max_size=12)

    @rule(tokens=tokens)
    def request(self, tokens: list[int]) -> None:
        _start_request(self, tokens)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def finish(self, data) -> None:
        tokens = _finish_request(self, data)
        for n in range(1, len(tokens) // 2 + 1):
            self.reference.setdefault(tuple(tokens[: 2 * n]), 0)

    @rule(n=st.integers(1, 20))
    def evict(self, n: int) -> None:
        pinned = {p for _, pages, hit in self.held for p in hit.pages}
        before = set(self.cache.tree.device_pages())
        self.cache.evict(n)
        assert pinned <= set(self.cache.tree.device_pages()), "a pinned page was evicted"
        assert set(self.cache.tree.device_pages()) <= before

    @invariant()
    def pages_are_owned_once(self) -> None:
        tree_pages = self.cache.tree.device_pages()
        assert self.cache.tree.num_device_pages == len(tree_pages), "the tree miscounts its L1 pages"
        request_pages = [p for _, pages, hit in self.held for p in pages[len(hit.pages):]]
        owned = tree_pages + request_pages
        assert len(owned) == len(set(owned)), "a page has two owners"
        assert len(owned) == self.alloc.num_used, "a page leaked or was freed while in use"
        assert self.cache.num_cached_pages == len(tree_pages)
        self.alloc.check()

    @invariant()
    def matches_are_cached_prefixes(self) -> None:
        for prefix in list(self.reference)[:20]:
            m = self.cache.tree.match(prefix)
            matched = tuple(prefix[: 2 * len(m.device_pages)])
            assert not matched or matched in self.reference
            assert all(n.device is not None for n in self._path(m.device_node))

    @staticmethod
    def _path(node):
        while node.parent is not None:
            yield node
            node = node.parent


TestTreeMachine = TreeMachine.TestCase
TestTreeMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("page_size", [1, 4])
def test_engine_with_radix_cache_gives_identical_outputs(tiny_llama: Path, page_size: int) -> None:
    gen = torch.Generator().manual_seed(5)
    system = torch.randint(2, 384, (40,), generator=gen).tolist()
    prompts = [system + torch.randint(2, 384, (5 + i,), generator=gen).tolist() for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=page_size, max_total_tokens=4096))
    expected = plain.generate(prompts, params)

    def cache(alloc, pool):
        return RadixCache(alloc, pool.page_size, SEED)

    # a pool too small for all requests at once: hits, evictions and preemptions all happen
    engine = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=page_size, max_total_tokens=160),
                    prefix_cache=cache)
    assert engine.generate(prompts[:1], params) == expected[:1]
    engine.add_request("again", prompts[1], params)
    cached = []
    while engine.has_work():
        cached += [o.cached_tokens for o in engine.step() if o.finished]
    assert cached[0] >= 40 // page_size * page_size
    assert engine.generate(prompts, params) == expected
    assert engine.allocator.num_used == engine.cache.num_cached_pages
    engine.cache.evict(10**6)
    assert engine.allocator.num_used == 0
    engine.allocator.check()


class HiCacheMachine(RuleBasedStateMachine):
    """Random request/finish/evict/settle sequences over L1 and L2 (write-through, loads back from
    host): every device and host page has exactly one owner, pins hold, paths stay contiguous."""

    def __init__(self) -> None:
        super().__init__()
        from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
        from tierserve.cache.hicache import HiCache, HiCacheConfig
        from tierserve.cache.host_pool import HostKVPool, HostLayout

        geometry = KVGeometry(1, 1, 2, 2, torch.float32)
        self.alloc = PageAllocator(24)
        device = DeviceKVPool(geometry, 24, torch.device("cpu"))
        host = HostKVPool(geometry, 12, HostLayout.PAGE_FIRST_DIRECT)
        self.cache = HiCache(self.alloc, device, host, SEED, HiCacheConfig())
        self.held: list = []

    def teardown(self) -> None:
        self.cache.close()

    @rule(tokens=TreeMachine.tokens)
    def request(self, tokens: list[int]) -> None:
        _start_request(self, tokens)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def finish(self, data) -> None:
        _finish_request(self, data)

    @rule(n=st.integers(1, 12))
    def evict_device(self, n: int) -> None:
        pinned = {p for _, _, hit in self.held for p in hit.pages}
        self.cache.evict(n)
        assert pinned <= set(self.cache.tree.device_pages()), "a pinned page was evicted"

    @rule(n=st.integers(1, 8))
    def evict_host(self, n: int) -> None:
        self.cache.host.allocator.free(self.cache.tree.evict_host(n))

    @rule()
    def settle(self) -> None:
        self.cache.wait_background(timeout=10)

    @invariant()
    def pages_have_one_owner(self) -> None:
        tree = self.cache.tree
        device = tree.device_pages() + [p for _, pages, hit in self.held for p in pages[len(hit.pages):]]
        assert len(device) == len(set(device)) == self.alloc.num_used
        in_flight = [p for w in self.cache._writes for p in w.host_pages]
        host = tree.host_pages() + in_flight
        assert len(host) == len(set(host)) == self.cache.host.allocator.num_used
        self.alloc.check()
        self.cache.host.allocator.check()

    @invariant()
    def device_nodes_have_device_parents(self) -> None:
        for node in self.cache.tree.nodes():
            if node.device is not None and node.parent.parent is not None:
                assert node.parent.device is not None
            assert node.device is not None or node.host is not None


TestHiCacheMachine = HiCacheMachine.TestCase
TestHiCacheMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
