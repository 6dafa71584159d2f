"""The invariants the HiCache state machine checks after every rule (``test_hicache_machine``)."""

from __future__ import annotations

from collections import Counter

from hypothesis.stateful import invariant

from helpers.hicache_fakes import CAP, PS, assert_loads_tracked, loaded, value
from tierserve.cache.hashing import page_keys
from tierserve.cache.radix_tree import Node


class L3Invariants:
    """Mixed into ``L3Machine``: reads its ``cache``, ``alloc``, ``host``, ``store``, ``held``,
    ``waiting``, ``computed``, ``computed_keys`` and ``threaded``, and changes nothing."""


    @invariant()
    def pages_have_one_owner(self) -> None:
        tree = self.cache.tree
        orphans = list(self.cache.loads._orphans)  # a failed load's pages, out of the tree until freed
        device = tree.device_pages() + [p for h in self.held for p in h.pages[len(h.hit.pages) :]] + orphans
        assert len(device) == len(set(device)) == self.alloc.num_used, "an L1 page leaked or has two owners"
        assert tree.num_device_pages == len(tree.device_pages()), "the tree miscounts its L1 pages"
        tier = self.cache.storage
        host = (tree.host_pages() + [p for w in self.cache._writes for p in w.host_pages]
                + [p for t in tier.tickets for p in (t.leftover if t.consumed else t.host_pages)])
        assert len(host) == len(set(host)) == self.host.allocator.num_used, "an L2 page leaked or has two owners"
        self.alloc.check()
        self.host.allocator.check()

    @invariant()
    def prefetches_stay_under_the_cap(self) -> None:
        tier = self.cache.storage
        live = [t for t in tier.tickets if not t.consumed]
        assert tier._reserved == sum(len(t.host_pages) for t in live) <= CAP
        running = [t for _, _, t in self.waiting if t is not None]
        assert {id(t) for t in live} == {id(t) for t in running}, "a prefetch outlived its request"
        for t in tier.tickets:
            assert len(t.keys) == len(t.host_pages) <= t.agreed_probed or not t.host_pages, \
                "a prefetch reads more pages than L3 said it has"
            assert not t.consumed or not t.decided or (t.host_pages and not t.agreed_done), \
                "a consumed prefetch whose reader stopped everywhere was not retired"

    @invariant()
    def locks_count_pins(self) -> None:
        tree = self.cache.tree
        pins = ([h.hit.handle for h in self.held] + [w.node for w in self.cache._writes]
                + [b.node for b in self.cache.storage._backups])
        expected: Counter[int] = Counter()
        roots = {id(r) for r in tree.roots.values()}
        for pin in pins:
            assert isinstance(pin, Node)
            top = pin
            while top.parent is not None:
                assert top.parent.children.get(top.tokens[:PS]) is top, "a pinned node left the tree"
                expected[id(top)] += 1
                top = top.parent
            assert id(top) in roots
        for node in tree.nodes():
            assert node.lock == expected[id(node)], "a lock count differs from the pins held"
        pinned = sum(len(n.device) for n in tree.nodes() if n.lock and n.device is not None)
        assert tree.num_pinned_device_pages == pinned, "the tree miscounts its pinned L1 pages"

    @invariant()
    def loads_are_tracked(self) -> None:
        assert_loads_tracked(self.cache)

    @invariant()
    def tree_matches_the_reference(self) -> None:
        """Keys chain along token paths, paths are computed prefixes, L1 nodes hang under L1
        nodes, and every page in L1 or L2 holds its key's KV.

        Which loads are done is read before the pages are: with worker threads a load that finished
        while the pages were read was checked against values from before it (a CI run's threaded
        machine saw 0.0 that way)."""
        settled = {id(n) for n in self.cache.tree.nodes() if loaded(n)}
        dev_low, dev_high = self._device_values()
        host_low, host_high = self._host_values()
        for salt, root in self.cache.tree.roots.items():
            stack = [(child, (), root.seed) for child in root.children.values()]
            while stack:
                node, prefix, parent_key = stack.pop()
                path = prefix + node.tokens
                assert node.keys == page_keys(parent_key, node.tokens, PS), "a node's keys are not its path's"
                assert (salt, path) in self.computed, "the tree holds a prefix no request computed"
                assert node.device is not None or node.host is not None
                if node.device is not None:
                    assert node.parent is root or node.parent.device is not None, "an L1 node under an L2-only one"
                    if id(node) in settled:
                        for p, k in zip(node.device, node.keys, strict=True):
                            assert dev_low[p] == dev_high[p] == value(k), "an L1 page holds other KV"
                if node.host is not None:
                    for p, k in zip(node.host, node.keys, strict=True):
                        assert host_low[p] == host_high[p] == value(k), "an L2 page holds other KV"
                stack += [(c, path, node.keys[-1]) for c in node.children.values()]

    @invariant()
    def only_the_l3_worker_calls_l3(self) -> None:
        if self.threaded:
            lanes = {"hicache-l3-backup", "hicache-l3-prefetch"}
            assert self.store.callers <= lanes, f"L3 called from {sorted(self.store.callers)}"

    @invariant()
    def l3_holds_only_computed_pages(self) -> None:
        with self.store._lock:
            objects = dict(self.store.objects)
        for key, data in objects.items():
            assert key in self.computed_keys, "L3 holds a page no request computed"
            assert bool((data == value(key)).all()), "an L3 page holds other KV"


