"""Page-granular radix tree over token ids: which prefixes have KV, and in which tier.

Every node holds a run of whole pages: their tokens, one key per page (see ``hashing``), the L1
(device) page indices or None, and the L2 (host) page indices or None. Invariant: a node with
device pages has a parent with device pages (or the root), so a match is one contiguous prefix,
its L1 part first, then its L2 part. Nodes are pinned by ``lock`` while requests or transfers use
them; only unpinned nodes are evicted, least recently used first.

KV events: an optional ``listener`` hears, per node, when its pages gain or lose a device or a
host copy (keys and tier; a split changes no page's tiers, so it says nothing). Code outside
this module changes a node's tiers only through ``set_device`` / ``set_host`` so it is heard.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierserve.cache.events import DEVICE, HOST, KVEventListener
from tierserve.cache.hashing import page_keys, salted_seed

_clock = itertools.count()


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...] = ()
    keys: list[bytes] = field(default_factory=list)
    device: list[int] | None = None
    host: list[int] | None = None
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    lock: int = 0
    hits: int = 0
    last_access: int = field(default_factory=lambda: next(_clock))
    seed: bytes | None = None  # roots only: the (salted) seed their pages' keys chain from
    loading: Any = None  # the L2 -> L1 load filling ``device``; cleared once every rank agreed it done
    writing: bool = False  # an L1 -> L2 copy of this node is in flight
    from_storage: bool = False  # host pages prefetched from L3 and not used yet (for the cache report)

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    def touch(self) -> None:
        self.last_access = next(_clock)


@dataclass
class Match:
    """A prompt's cached prefix: ``device_pages`` (L1) then ``host_pages`` (L2), contiguous.

    ``device_node`` is the deepest node of the L1 part, ``last_node`` the deepest matched node
    (equal when nothing came from L2); lock ``last_node`` to pin the whole path.
    """

    device_pages: list[int]
    host_pages: list[int]
    device_node: Node
    last_node: Node
    host_nodes: list[Node] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return len(self.device_pages) + len(self.host_pages)


class RadixTree:
    """The tree; it decides nothing about memory: callers free the pages the tree gives back."""

    def __init__(self, page_size: int, seed: bytes, listener: KVEventListener | None = None) -> None:
        self.page_size = page_size
        self.seed = seed
        self.listener = listener  # None: no events, no cost beyond one test per change
        self.num_device_pages = 0  # kept as pages come and go, so counting them never walks the tree
        self.num_pinned_device_pages = 0  # of those, in pinned nodes (requests, copies): not evictable now
        self.roots: dict[str, Node] = {}
        self.root = self._root("")

    def _root(self, salt: str) -> Node:
        """One root per salt (a scope's, ``CacheScope.salt``): scopes never match each other's pages, and their
        keys chain from different seeds."""
        if salt not in self.roots:
            self.roots[salt] = Node(keys=[], device=[], host=[], lock=1, seed=salted_seed(self.seed, salt))
        return self.roots[salt]

    # -- lookup --------------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], salt: str = "") -> Match:
        """Longest cached page-aligned prefix; splits a node where the match ends inside it."""
        node, pages = self._root(salt), self._pages(token_ids)
        device: list[int] = []
        host: list[int] = []
        host_nodes: list[Node] = []
        device_node = node
        i = 0
        while i < len(pages) and (child := node.children.get(pages[i])) is not None:
            n = _common_pages(child, pages[i:], self.page_size)
            if n < child.num_pages:
                child = self._split(child, n)
            child.touch()
            child.hits += 1
            if child.device is not None:
                device += child.device
                device_node = child
            elif child.host is not None:
                host += child.host
                host_nodes.append(child)
            else:
                break
            node, i = child, i + n
        return Match(device, host, device_node, node, host_nodes)

    def _pages(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(token_ids[i : i + ps]) for i in range(0, len(token_ids) - ps + 1, ps)]

    # -- insertion -----------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], device_pages: list[int], salt: str = "") -> tuple[list[int], Node]:
        """Records that ``device_pages`` hold the KV of the full pages of ``token_ids``.

        Returns the pages the tree did not take (their tokens were already on the device: the
        caller frees them) and the deepest node of the inserted path. Host-only nodes on the way
        take the new device pages (they are back on L1).
        """
        pages = self._pages(token_ids)[: len(device_pages)]
        node, i, unused = self._root(salt), 0, []
        while i < len(pages) and (child := node.children.get(pages[i])) is not None:
            n = _common_pages(child, pages[i:], self.page_size)
            if n < child.num_pages:
                child = self._split(child, n)
            if child.device is None:
                self.set_device(child, device_pages[i : i + n])
            else:  # the caller's own copy of pages the tree has; the same index is the same page
                unused += [p for p, q in zip(device_pages[i : i + n], child.device, strict=True) if p != q]
            child.touch()
            node, i = child, i + n
        if i < len(pages):
            node = self._add_child(node, pages[i:], device=list(device_pages[i:]))
        return unused, node

    def add_host_child(self, parent: Node, token_ids: Sequence[int], host_pages: list[int]) -> Node:
        """Hangs a host-only node (e.g. pages prefetched from L3) below ``parent``, which must not
        have a child starting with the same page."""
        pages = self._pages(token_ids)
        if len(pages) != len(host_pages) or len(token_ids) % self.page_size:
            raise ValueError("radix tree: host pages must cover the tokens exactly, in whole pages")
        if pages[0] in parent.children:
            raise ValueError("radix tree: the parent already has that child")
        return self._add_child(parent, pages, host=list(host_pages))

    def set_device(self, node: Node, pages: list[int] | None) -> None:
        """Gives ``node`` device pages (an L2 -> L1 load) or takes them away (None); the caller
        owns the pages taken away."""
        self._set_tier(node, DEVICE, pages)

    def set_host(self, node: Node, pages: list[int] | None) -> None:
        """Gives ``node`` host pages (an L1 -> L2 copy landed) or takes them away (None)."""
        self._set_tier(node, HOST, pages)

    def _set_tier(self, node: Node, medium: str, pages: list[int] | None) -> None:
        had = (node.device if medium == DEVICE else node.host) is not None
        if pages is not None and len(pages) != node.num_pages:
            raise ValueError(f"radix tree: {len(pages)} {medium} pages for a node of {node.num_pages}")
        if medium == DEVICE:
            change = len(pages or []) - len(node.device or [])
            self.num_device_pages += change
            self.num_pinned_device_pages += change if node.lock else 0
            node.device = pages
        else:
            node.host = pages
        if self.listener is not None and had != (pages is not None):
            self._announce(node, medium, pages is not None)

    def _along(self, token_ids: Sequence[int], salt: str) -> Iterator[tuple[Node, int]]:
        """The nodes holding ``token_ids``' cached page-aligned prefix, root first, each with how
        many of its pages the prefix covers (only the last may be partly covered); changes nothing
        (no split, no touch)."""
        node, pages, i = self.roots.get(salt), self._pages(token_ids), 0
        while node is not None and i < len(pages) and (child := node.children.get(pages[i])) is not None:
            n = _common_pages(child, pages[i:], self.page_size)
            yield child, n
            node, i = (child if n == child.num_pages else None), i + n

    def cached_pages(self, token_ids: Sequence[int], salt: str = "") -> int:
        """How many leading pages of ``token_ids`` are in L1 or L2; changes nothing."""
        return sum(n for _, n in self._along(token_ids, salt))

    def loading_under(self, token_ids: Sequence[int], salt: str = "") -> bool:
        """Whether a node holding part of ``token_ids``' cached prefix is still ``loading`` (its
        L1 pages not yet agreed landed); changes nothing."""
        return any(node.loading is not None for node, _ in self._along(token_ids, salt))

    def copies_along(self, token_ids: Sequence[int], salt: str = "") -> tuple[list[int], int]:
        """The pages of the longest page-aligned prefix of ``token_ids`` the tree holds, in order:
        each node's device pages, or its host pages where it has none (its L1 part comes first);
        and how many of them are device pages. Changes nothing (no split, no touch)."""
        found: list[int] = []
        on_device = 0
        for node, n in self._along(token_ids, salt):
            copy = node.device if node.device is not None else node.host
            if copy is None:  # no copy (none should be left so): the path stops here, as for ``match``
                break
            found += copy[:n]
            on_device += n if node.device is not None else 0
        return found, on_device

    def _add_child(self, parent: Node, pages: list[tuple[int, ...]], device: list[int] | None = None,
                   host: list[int] | None = None) -> Node:
        tokens = tuple(t for page in pages for t in page)
        parent_key = parent.keys[-1] if parent.keys else parent.seed
        child = Node(tokens, page_keys(parent_key, tokens, self.page_size), device=device, host=host, parent=parent)
        parent.children[pages[0]] = child
        self.num_device_pages += len(device or [])
        if self.listener is not None:
            self._announce(child, DEVICE if device is not None else HOST, True)
        return child

    def _announce(self, node: Node, medium: str, stored: bool) -> None:
        """Tells the listener that ``node``'s pages gained (or lost) their copy in ``medium``."""
        if stored:
            parent = node.parent.keys[-1] if node.parent is not None and node.parent.keys else None
            self.listener.stored(node.keys, parent, node.tokens, medium)
        else:
            self.listener.removed(node.keys, medium)

    def _split(self, node: Node, n: int) -> Node:
        """Cuts ``node`` after its first ``n`` pages; returns the new upper part (the lock and
        access time are shared, so pins taken on the lower part still cover the upper part)."""
        ps = self.page_size
        upper = Node(node.tokens[: n * ps], node.keys[:n], _head(node.device, n), _head(node.host, n),
                     node.parent, lock=node.lock, hits=node.hits, last_access=node.last_access,
                     loading=node.loading, writing=node.writing, from_storage=node.from_storage)
        node.parent.children[node.tokens[:ps]] = upper
        node.tokens, node.keys = node.tokens[n * ps :], node.keys[n:]
        node.device, node.host = _tail(node.device, n), _tail(node.host, n)
        node.parent = upper
        upper.children[node.tokens[:ps]] = node
        return upper

    # -- pins ----------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Pins ``node`` and its ancestors (a request or transfer relies on the whole path)."""
        for n in path_to_root(node):
            if n.lock == 0:
                self.num_pinned_device_pages += len(n.device or [])
            n.lock += 1

    def unlock(self, node: Node) -> None:
        for n in path_to_root(node):
            if n.lock <= 0:
                raise RuntimeError("radix tree: unlock of an unlocked node")
            n.lock -= 1
            if n.lock == 0:
                self.num_pinned_device_pages -= len(n.device or [])

    # -- eviction ------------------------------------------------------------------------------

    def evict_device(
        self, num_pages: int, backup: Callable[[Node], bool] | None = None
    ) -> tuple[list[int], list[int]]:
        """Drops the device copy of least recently used unpinned nodes at the bottom of the L1
        subtree until ``num_pages`` pages are found. A node without a host copy is first offered
        to ``backup`` (write-back: it may give the node host pages); a node with a host copy stays,
        host-only; one without is deleted (with any host-only nodes below it). Returns the
        (device, host) pages freed."""
        freed_device: list[int] = []
        freed_host: list[int] = []
        heap = _lru_heap(n for n in self.nodes() if _device_evictable(n))
        while len(freed_device) < num_pages and heap:
            victim = heapq.heappop(heap)[2]
            if victim.host is None and backup is not None:
                backup(victim)
            freed_device += victim.device
            self.set_device(victim, None)
            if victim.host is None:
                freed_host += self._delete_subtree(victim)
            if victim.parent.parent is not None and _device_evictable(victim.parent):
                heapq.heappush(heap, _lru_entry(victim.parent))
        return freed_device, freed_host

    def next_device_victims(self, num_pages: int) -> list[Node]:
        """The nodes ``evict_device(num_pages)`` would take, in its order, without taking them."""
        heap = _lru_heap(n for n in self.nodes() if _device_evictable(n))
        taken: set[int] = set()
        victims: list[Node] = []
        while heap and num_pages > 0:
            node = heapq.heappop(heap)[2]
            taken.add(id(node))
            victims.append(node)
            num_pages -= node.num_pages
            if node.parent.parent is not None and _device_evictable(node.parent, taken):
                heapq.heappush(heap, _lru_entry(node.parent))
        return victims

    def evict_host(self, num_pages: int) -> list[int]:
        """Deletes least recently used unpinned host-only leaves until ``num_pages`` host pages are
        found; returns them."""
        freed: list[int] = []
        heap = _lru_heap(n for n in self.nodes() if _host_evictable(n))
        while len(freed) < num_pages and heap:
            victim = heapq.heappop(heap)[2]
            parent = victim.parent
            freed += self._delete_subtree(victim)
            if parent.parent is not None and _host_evictable(parent):
                heapq.heappush(heap, _lru_entry(parent))
        return freed

    def _delete_subtree(self, node: Node) -> list[int]:
        """Unlinks ``node``; returns the host pages of it and everything below (none on device)."""
        del node.parent.children[node.tokens[: self.page_size]]
        freed = []
        for n in subtree(node):
            if n.device is not None and n is not node:
                raise RuntimeError("radix tree: deleting a node with device pages below it")
            freed += n.host or []
            if self.listener is not None and n.host is not None:
                self._announce(n, HOST, False)
        return freed

    # -- inspection ----------------------------------------------------------------------------

    def nodes(self) -> Iterator[Node]:
        """Every node except the root."""
        for root in self.roots.values():
            for child in root.children.values():
                yield from subtree(child)

    def snapshot(self) -> list[tuple[bytes, str]]:
        """(key, medium) of every page copy the tree holds: a page in L1 and L2 appears twice.
        The state the listener's events add up to, for a subscriber that lost some."""
        out = []
        for n in self.nodes():
            for medium, pages in ((DEVICE, n.device), (HOST, n.host)):
                if pages is not None:
                    out += [(k, medium) for k in n.keys]
        return out

    def device_pages(self) -> list[int]:
        return [p for n in self.nodes() for p in n.device or []]

    def host_pages(self) -> list[int]:
        return [p for n in self.nodes() for p in n.host or []]


def _common_pages(node: Node, pages: list[tuple[int, ...]], page_size: int) -> int:
    n = 0
    while n < min(node.num_pages, len(pages)) and node.tokens[n * page_size : (n + 1) * page_size] == pages[n]:
        n += 1
    return n


def _head(values: list[int] | None, n: int) -> list[int] | None:
    return None if values is None else values[:n]


def _tail(values: list[int] | None, n: int) -> list[int] | None:
    return None if values is None else values[n:]


def path_to_root(node: Node) -> Iterator[Node]:
    """``node`` and its ancestors, up to (without) the root."""
    while node.parent is not None:
        yield node
        node = node.parent


def path_pages(node: Node) -> list[int]:
    """The L1 pages from the root down to ``node`` (a pinned or just inserted path has them all)."""
    return [p for n in reversed(list(path_to_root(node))) for p in n.device]


def subtree(node: Node) -> Iterator[Node]:
    """``node`` and everything below it."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def _lru_entry(node: Node) -> tuple[int, int, Node]:
    return node.last_access, id(node), node


def _lru_heap(nodes: Iterator[Node]) -> list[tuple[int, int, Node]]:
    heap = [_lru_entry(n) for n in nodes]
    heapq.heapify(heap)
    return heap


def _device_evictable(node: Node, taken: frozenset[int] | set[int] = frozenset()) -> bool:
    """Unpinned, on L1 and not loading (``loading`` is cleared once every rank agreed the load
    done, so every rank evicts alike), with no child on L1 except the ``taken`` ones (by id)."""
    return (node.lock == 0 and node.device is not None and node.loading is None
            and all(c.device is None or id(c) in taken for c in node.children.values()))


def _host_evictable(node: Node) -> bool:
    return node.lock == 0 and node.device is None and node.host is not None and not node.children
