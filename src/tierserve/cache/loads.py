"""L2 -> L1 loads that complete layer by layer, and the clean-up after one fails.

A failed load leaves garbage in the device pages the tree already lists for its nodes. ``Loads``
takes those device copies out of the tree (the nodes keep their host copies, so a later match
loads them again) and keeps the pages out of the allocator until no request holds them any more
and nothing still writes them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.base import PrefixHit
from tierserve.cache.radix_tree import RadixTree, subtree
from tierserve.cache.sharded.agreement import leading_true

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 60.0  # a host memory copy that runs this long after it failed is hung


class HostLoadError(RuntimeError):
    """Copying a prefix's KV from host memory failed: the request cannot use the pages it was lent."""


class LayerwiseLoad:
    """An L2 -> L1 copy whose layers complete one after another (``wait(i)`` blocks for layer i).

    ``finished()``: the copy stopped (well or not) and no longer writes its pages. ``done()``: it
    finished well, so its pages are usable; a failed load is never done, and every ``wait`` on it
    raises ``HostLoadError``. A load is failed when its copy raised or when a waiter gave it up
    (``give_up``: not copied in time); a given-up copy stops after the layer it is copying.
    """

    def __init__(self, num_layers: int) -> None:
        self._layers = [threading.Event() for _ in range(num_layers)]
        self.error: BaseException | None = None
        # the tree nodes it fills: their ``loading`` stays set until every rank agreed it done, so
        # eviction and later matches, which read it, decide alike on every rank
        self.nodes: list = []
        self.landed = False  # every rank agreed it done (set at the same step on every rank)

    def run(self, copy_layer: Callable[[int], None]) -> None:
        try:
            for i, event in enumerate(self._layers):
                if self.error is not None:
                    break  # given up: write nothing more
                copy_layer(i)
                event.set()
        except BaseException as exc:
            self.error = self.error or exc  # before the events: whoever sees an event set sees the error
        if self.error is not None:
            for event in self._layers:
                event.set()

    def wait(self, layer: int, timeout: float | None = None) -> None:
        """Blocks until layer ``layer`` is copied (-1: the whole copy), at most ``timeout`` seconds
        (None: no bound); a copy not there by then is given up. Raises ``HostLoadError`` if the copy
        failed or was given up."""
        if not self._layers[layer].wait(None if timeout is None else max(0.0, timeout)):
            self.give_up(TimeoutError(f"layer {layer} of an L2 -> L1 copy was not there within {timeout:.3g} s"))
        if self.error is not None:
            raise HostLoadError("loading KV from host memory failed") from self.error

    def give_up(self, reason: BaseException) -> None:
        """Fails the load now (its copy thread stops after its current layer, then ``finished``)."""
        if self.error is None:
            self.error = reason

    def finished(self) -> bool:
        return self._layers[-1].is_set()

    def join(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Blocks until the copy stopped writing its pages (a host memory copy: briefly). A copy
        that hangs past ``timeout`` raises ``RuntimeError``: its pages can never be freed safely,
        so the rank stops (and its node with it, docs/ranks.md) rather than hang for good."""
        if not self._layers[-1].wait(timeout):
            raise RuntimeError(f"an L2 -> L1 copy still runs {timeout:.0f} s after it was given up")

    def done(self) -> bool:
        return self.finished() and self.error is None

    @property
    def failed(self) -> bool:
        return self.error is not None


class Loads:
    """The loads in flight, the device pages each live hit lends its request, and the pages taken
    out of the tree after a failed load (orphans). Engine thread only; every ``match`` is paired
    with one ``release`` (``lent`` / ``returned``). Until the step boundary that drops a failed
    load, its nodes keep their device pages but are neither evictable nor usable: the load is not
    ``done``, so requests that match them wait on it and fail too."""

    def __init__(self, tree: RadixTree, allocator: PageAllocator) -> None:
        self.tree, self.allocator = tree, allocator
        self.running: list[LayerwiseLoad] = []
        self.failures = 0
        self._lent: dict[int, list[int]] = {}  # id(hit) -> its pages
        self._orphans: dict[int, LayerwiseLoad | None] = {}  # page -> the load that may still write it

    @property
    def num_orphans(self) -> int:
        return len(self._orphans)

    def started(self, load: LayerwiseLoad) -> None:
        self.running.append(load)

    def lent(self, hit: PrefixHit) -> None:
        self._lent[id(hit)] = hit.pages

    def returned(self, hit: PrefixHit) -> None:
        self._lent.pop(id(hit), None)

    def is_orphan(self, page: int) -> bool:
        return page in self._orphans

    def usable(self, pages: list[int]) -> int:
        """How many leading ``pages`` (a request's page table) hold valid KV as far as loads go:
        everything from the first orphan on was computed from, or is, garbage."""
        return next((i for i, p in enumerate(pages) if p in self._orphans), len(pages))

    def local_state(self) -> list[int]:
        """This rank's view, for the agreement: [leading loads done, index of the first failed load
        (``len(running)`` if none)]. ``running`` is the same list on every rank (loads start in
        ``match``), so indices agree."""
        failed = next((i for i, x in enumerate(self.running) if x.failed), len(self.running))
        return [leading_true(x.done() for x in self.running), failed]

    def apply(self, done: int, failed: int) -> None:
        """Applies the agreed view: forgets the first ``done`` loads and, if a load failed on some
        rank, takes its device copies out of the tree on every rank (frees nothing: ``collect``)."""
        dropped = self.running[failed] if failed < len(self.running) else None
        for load in self.running[:done]:
            _landed(load)
        if dropped is not None:
            log.warning("L2 -> L1 load failed (%s); its requests fail, its nodes stay host-only", dropped.error)
            self.failures += 1
            self._drop(dropped)
        self.running = [x for i, x in enumerate(self.running) if i >= done and x is not dropped]

    def _drop(self, load: LayerwiseLoad) -> None:
        # Device nodes below a loaded node are dropped too (a device node needs a device parent);
        # they are other loads' nodes, still with their host copies: requests that computed on
        # garbage cannot exist, since every one of them waited on this load and failed. Each copy
        # still writing them is waited for here, at a step every rank takes, so that the orphans are
        # freed at the same step on every rank (a rank's own ``finished()`` would differ).
        for top in [n for n in self.tree.nodes() if n.loading is load]:
            for node in subtree(top):
                if node.device is None:
                    continue
                if node.loading is not None:
                    node.loading.join()
                self._orphans.update(dict.fromkeys(node.device))
                self.tree.set_device(node, None)
                node.loading = None
                if node.host is None:
                    log.error("radix tree: node %s under a failed load has no host copy left", node.keys[:1])

    def collect(self) -> None:
        """Frees orphans that no live hit holds and that no load still writes."""
        if not self._orphans:  # the usual case: skip the walk over every live hit's pages
            return
        held = {p for pages in self._lent.values() for p in pages if p in self._orphans}
        free = [p for p, writer in self._orphans.items()
                if p not in held and (writer is None or writer.finished())]
        for p in free:
            del self._orphans[p]
        self.allocator.free(free)


def _landed(load: LayerwiseLoad) -> None:
    """Every rank has ``load``'s pages: its nodes stop being ``loading`` (evictable again).

    A node split while loading keeps its lower part (the listed node) and hangs a new upper part,
    ``loading`` too, just above it; so each listed node's chain of parents that share the load is
    cleared, or such an upper part would stay ``loading``, never evictable, for good."""
    load.landed = True
    for node in load.nodes:
        while node.parent is not None and node.loading is load:
            node.loading = None
            node = node.parent
