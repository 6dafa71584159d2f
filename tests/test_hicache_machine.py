"""HiCache over L1, L2 and L3 driven by a hypothesis state machine, against a reference model.

The machine mirrors the engine's call order (``engine.scheduler``): ``prefetch`` when a request
arrives, ``on_step`` then ``ready`` then ``match`` (of all but the last token) when it is admitted,
``release`` when it finishes, ``cancel`` when it is aborted while waiting, ``evict`` for room. Its
other rules evict and flush L1 and L2, run background work, settle (``wait_background``), take L3
down and bring it back, and lose single L3 objects.

Reference model: the set of (salt, token prefix) pages that requests computed and released. Every
page of KV written by a request holds a value derived from its page key, so every check on data is
exact: whatever a tier holds under a key, and whatever a match returns, is that key's value.

Background work runs on step-by-step executors by default (the machine decides when each queued
L1 <-> L2 copy or L3 call runs, so examples replay exactly and shrink); ``ThreadedL3Machine`` runs
the same rules on the cache's own worker threads.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.hashing import page_keys, salted_seed
from tierserve.cache.hicache import HiCache, HiCacheConfig
from tierserve.cache.host_pool import HostKVPool, HostLayout
from tierserve.cache.prefetch import Prefetch, PrefetchOptions
from tierserve.cache.radix_tree import Node
from tierserve.cache.storage import StorageBackend
from tierserve.cache.storage.base import StorageError

PS = 2  # tokens per page
SEED = b"m" * 32
DEVICE_PAGES, HOST_PAGES = 12, 24
OPTIONS = PrefetchOptions(threshold_tokens=PS, max_reserved_fraction=0.5)  # prefetch from one page on
CAP = int(HOST_PAGES * OPTIONS.max_reserved_fraction)  # host pages all running prefetches may reserve
MAX_TOKENS = 16
PARTIAL = -1.0  # the value of a request's last, partial page (it has no key)


def value(key: bytes) -> float:
    """The KV every layer, head and token of the page named ``key`` holds (exact in float32)."""
    return float(int.from_bytes(key[:2], "little") + 1)


def keys_of(tokens: list[int] | tuple[int, ...], salt: str) -> list[bytes]:
    return page_keys(salted_seed(SEED, salt), tokens, PS)


class MemoryStorage(StorageBackend):
    """L3 in a dict. ``down`` makes every call raise, as an unreachable store does."""

    def __init__(self) -> None:
        self.objects: dict[bytes, torch.Tensor] = {}
        self.down = False
        self.calls = 0
        self.callers: set[str] = set()  # threads that called
        self._lock = threading.Lock()

    def _call(self) -> None:
        with self._lock:
            self.calls += 1
            self.callers.add(threading.current_thread().name)
        if self.down:
            raise StorageError("store unreachable (test outage)")

    def present(self, keys: list[bytes]) -> int:
        """``batch_exists`` for the test itself: no call counted, works while down."""
        with self._lock:
            return next((i for i, k in enumerate(keys) if k not in self.objects), len(keys))

    def batch_exists(self, keys: list[bytes]) -> int:
        self._call()
        return self.present(keys)

    def batch_get_into(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        self._call()
        out = []
        for key, span in zip(keys, spans, strict=True):
            with self._lock:
                data = self.objects.get(key)
            if data is not None:
                span.copy_(data)
            out.append(data is not None)
        return out

    def batch_set_from(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        self._call()
        with self._lock:
            for key, span in zip(keys, spans, strict=True):
                self.objects.setdefault(key, span.clone())
        return [True] * len(keys)

    def get(self, key: bytes) -> bytes | None:
        self._call()
        with self._lock:
            data = self.objects.get(key)
        return None if data is None else data.numpy().tobytes()

    def set(self, key: bytes, data: bytes) -> bool:
        raise NotImplementedError

    def clear(self) -> None:
        with self._lock:
            self.objects.clear()

    def stats(self) -> dict[str, Any]:
        return {"pages": len(self.objects), "calls": self.calls}


class FaultyLoader:
    """The cache's L2 -> L1 loader with host-memory faults on demand: after ``arm(layer)`` the next
    load started fails while copying ``layer`` (its earlier layers are copied), as a failing
    host-to-device copy does; the decision is taken on the engine thread, so it replays alike."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.armed: int | None = None

    def submit(self, fn, copy_layer) -> Future:
        if self.armed is None:
            return self.inner.submit(fn, copy_layer)
        layer, self.armed = self.armed, None

        def faulty(i: int) -> None:
            if i == layer:
                raise RuntimeError("host memory copy failed (test fault)")
            copy_layer(i)

        return self.inner.submit(fn, faulty)

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait)


class StepExecutor:
    """A single-worker executor whose tasks run, in order, only when the test says so."""

    def __init__(self) -> None:
        self.queue: deque[tuple[Future, Any, tuple]] = deque()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.queue.append((future, fn, args))
        return future

    def run(self, n: int) -> None:
        for _ in range(min(n, len(self.queue))):
            future, fn, args = self.queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the future, as a real executor does
                future.set_exception(exc)

    def shutdown(self, wait: bool = True) -> None:
        self.run(len(self.queue))


@dataclass
class Held:
    """A running request: its pages (the hit's, then its own) and its hit."""

    tokens: list[int]
    salt: str
    pages: list[int]
    hit: Any


def _pick(data, items: list) -> int | None:
    """An index into ``items`` (None if empty), drawn the same way whatever their number: with
    worker threads the number may depend on timing, and hypothesis needs the same draws on replay."""
    i = data.draw(st.integers(0, 63))
    return i % len(items) if items else None


def _path(node: Node):
    while node.parent is not None:
        yield node
        node = node.parent


def _subtree(node: Node):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def _loaded(node: Node) -> bool:
    return node.loading is None or node.loading.done()


class L3Machine(RuleBasedStateMachine):
    threaded = False

    def __init__(self) -> None:
        super().__init__()
        geometry = KVGeometry(2, 1, 2, PS, torch.float32)
        self.alloc = PageAllocator(DEVICE_PAGES)
        self.device = DeviceKVPool(geometry, DEVICE_PAGES, torch.device("cpu"))
        self.host = HostKVPool(geometry, HOST_PAGES, HostLayout.PAGE_FIRST_DIRECT)
        self.store = MemoryStorage()
        self.cache = HiCache(self.alloc, self.device, self.host, SEED, HiCacheConfig(prefetch=OPTIONS))
        if not self.threaded:
            self.cache._worker.shutdown()
            self.cache._loader.shutdown()
            self.cache._worker = self.cache._loader = self.io = StepExecutor()  # one queue the test runs
        self.loader = self.cache._loader = FaultyLoader(self.cache._loader)
        self.cache.attach_storage(self.store)
        if not self.threaded:
            self.cache.storage._worker.shutdown()
            self.cache.storage._reader.shutdown()
            self.cache.storage._worker = self.cache.storage._reader = self.l3 = StepExecutor()  # one queue
        self.held: list[Held] = []
        self.waiting: list[tuple[list[int], str, Prefetch | None]] = []
        # the reference model: every (salt, full-page prefix) a request computed and released
        self.computed: set[tuple[str, tuple[int, ...]]] = set()
        self.computed_keys: set[bytes] = set()
        self.history: list[tuple[list[int], str]] = []
        self.lossless = True  # L3 never failed nor lost an object: every backup must have landed

    def teardown(self) -> None:
        self.cache.close()

    # -- helpers ---------------------------------------------------------------------------------

    def _fill_device(self, page: int, v: float) -> None:
        self.device.buffer[:, :, page * PS : (page + 1) * PS] = v

    def _device_values(self) -> tuple[list[float], list[float]]:
        pages = self.device.buffer.unflatten(2, (DEVICE_PAGES, PS)).transpose(0, 2).flatten(1)
        return pages.amin(1).tolist(), pages.amax(1).tolist()

    def _host_values(self) -> tuple[list[float], list[float]]:
        pages = self.host.buffer.flatten(1)
        return pages.amin(1).tolist(), pages.amax(1).tolist()

    def _loads_ok(self, hit) -> bool:
        """Waits, as a step's attention does, until ``hit``'s loads stopped copying; False if one
        failed (the step raises ``HostLoadError`` and the engine fails the request)."""
        for load in hit.loads:
            if self.threaded:
                load.join()
            while not load.finished():
                assert self.io.queue, "a load was never queued"
                self.io.run(1)
        return not any(load.failed for load in hit.loads)

    def _loader_runs(self, n: int) -> None:
        """Between two matches of one step the loader thread copies on (threaded: on its own)."""
        if not self.threaded:
            self.io.run(n)

    def _drain(self) -> None:
        """Runs every queued copy and L3 call, and applies them, until nothing is left."""
        if self.threaded:
            self.cache.wait_background(timeout=10)
            return
        while self.io.queue or self.l3.queue or self.cache._writes or self.cache.storage._backups:
            self.io.run(len(self.io.queue))
            self.cache.on_step()
            self.l3.run(len(self.l3.queue))
            self.cache.on_step()
        self.cache.wait_background(timeout=1)  # nothing left to wait for: returns at once

    def _prefetch(self, tokens: list[int], salt: str) -> Prefetch | None:
        """``HiCache.prefetch``: a ticket, and no L3 call on the engine thread (the L3 worker asks)."""
        tier = self.cache.storage
        local = self.cache.tree.cached_pages(tokens, salt)
        healthy, calls = tier.agreed_healthy, self.store.calls
        ticket = self.cache.prefetch(tokens, salt)
        # unthreaded, the L3 worker runs only when the test says so; threaded, see MemoryStorage.callers
        assert self.threaded or self.store.calls == calls, "the engine thread called L3"
        if ticket is None:
            return None
        assert healthy, "a prefetch started although L3 was agreed down"
        assert ticket.start == local and (len(tokens) // PS - local) * PS >= OPTIONS.threshold_tokens
        assert ticket.keys == keys_of(tokens, salt)[local : len(tokens) // PS], "a prefetch asks for the wrong keys"
        assert not ticket.decided and not ticket.host_pages
        return ticket

    def _land(self, ticket: Prefetch) -> None:
        """Lets a ticket be probed, decided and read, and every rank agree on it."""
        for _ in range(60):
            if ticket.decided and (not ticket.host_pages or ticket.agreed_done):
                return
            if self.threaded:
                ticket.done.wait(0.05)  # the workers run on their own
            else:
                self.l3.run(len(self.l3.queue))
            self.cache.on_step()
        raise AssertionError("a prefetch did not land")

    def _take_pages(self, missing: int) -> list[int] | None:
        """``Scheduler._take_pages``: evicts L1 for what is missing, then takes the pages."""
        if self.alloc.num_free < missing:
            self.cache.evict(missing - self.alloc.num_free)
        pages = self.alloc.alloc(missing)
        while pages is None and self.cache.evict(missing) > 0:
            pages = self.alloc.alloc(missing)
        return pages

    def _admit(self, tokens: list[int], salt: str, ticket: Prefetch | None) -> Any:
        """``Scheduler._match`` and ``_take_pages``: match all but the last token, take pages for
        the rest, "compute" them (write their values); no pages: give the hit back."""
        prompt = tokens[:-1]
        hit = self.cache.match(prompt, ticket, salt)
        n = hit.num_tokens // PS
        assert hit.num_tokens == n * PS and len(hit.pages) == n and n <= len(prompt) // PS
        assert n == 0 or (salt, tuple(prompt[: n * PS])) in self.computed, "a match returned pages never computed"
        assert sum(hit.by_tier.values()) == hit.num_tokens
        pages = self._take_pages(-(-len(tokens) // PS) - n)
        if pages is None:
            self.cache.release(tokens, list(hit.pages), hit.num_tokens, hit)
            return hit
        keys = keys_of(tokens, salt)
        for j, page in enumerate(pages, start=n):
            self._fill_device(page, value(keys[j]) if j < len(keys) else PARTIAL)
        self.held.append(Held(tokens, salt, list(hit.pages) + pages, hit))
        return hit

    # -- requests --------------------------------------------------------------------------------

    def _draw(self, data) -> tuple[list[int], str]:
        """A prompt, mostly a cut of an earlier (often recent) one plus new tokens (a multi-turn
        conversation, mostly under its cache salt: a cut under another salt must not hit)."""
        base: list[int] = []
        salts = ["", "", "t"]
        if self.history and data.draw(st.integers(0, 3)):
            recent = data.draw(st.booleans())  # mostly a recent one: the same conversation goes on
            base, salt = data.draw(st.sampled_from(self.history[-3:] if recent else self.history))
            base = base[: data.draw(st.integers(0, len(base)))]
            salts = [salt, salt, salt, "", "t"]
        tokens = (base + data.draw(st.lists(st.integers(0, 2), min_size=0 if base else 1, max_size=8)))[:MAX_TOKENS]
        salt = data.draw(st.sampled_from(salts))
        self.history.append((tokens, salt))
        return tokens, salt

    @rule(data=st.data())
    def arrive(self, data) -> None:
        """``Scheduler.add``: the prefetch starts when the request arrives."""
        tokens, salt = self._draw(data)
        self.waiting.append((tokens, salt, self._prefetch(tokens, salt)))

    @rule(data=st.data())
    def schedule(self, data) -> None:
        """``Scheduler.schedule``: one step boundary, then up to ``budget`` waiting requests are
        matched in arrival order (those still prefetching passed over) with no step between, while
        the loader copies on; one that finds no pages gives its hit back and waits (its prefetch
        used up). Draws do not depend on how many were ready (threaded: timing)."""
        budget = data.draw(st.integers(1, 3))
        runs = data.draw(st.lists(st.integers(0, 2), min_size=3, max_size=3))
        self.cache.on_step()
        for entry in list(self.waiting):
            tokens, salt, ticket = entry
            if budget == 0:
                return
            if not self.cache.ready(ticket):
                continue
            held, i = len(self.held), next(i for i, e in enumerate(self.waiting) if e is entry)
            self._admit(tokens, salt, ticket)
            if len(self.held) == held:
                self.waiting[i] = (tokens, salt, None)
                return
            del self.waiting[i]
            budget -= 1
            self._loader_runs(runs[budget])

    @rule(data=st.data())
    def abort_waiting(self, data) -> None:
        if (i := _pick(data, self.waiting)) is None:
            return
        _, _, ticket = self.waiting.pop(i)
        self.cache.cancel(ticket)

    @rule(data=st.data())
    def finish(self, data) -> None:
        if (i := _pick(data, self.held)) is not None:
            self._finish(self.held.pop(i))

    def _fail(self, held: Held) -> None:
        """``Engine._fail_request``: a request whose hit's load failed is released having computed
        nothing past its hit (the step that would have raised first)."""
        self.cache.release(held.tokens, held.pages, held.hit.num_tokens, held.hit)

    def _finish(self, held: Held) -> None:
        if not self._loads_ok(held.hit):
            self._fail(held)
            return
        keys = keys_of(held.tokens, held.salt)
        low, high = self._device_values()
        for j, page in enumerate(held.hit.pages):
            assert low[page] == high[page] == value(keys[j]), f"hit page {j} does not hold its key's KV"
        self.cache.release(held.tokens, held.pages, len(held.tokens), held.hit)
        for j in range(1, len(keys) + 1):
            self.computed.add((held.salt, tuple(held.tokens[: j * PS])))
        self.computed_keys.update(keys)

    @rule(data=st.data())
    def checkpoint(self, data) -> None:
        """Continuous offload: a running request's full pages join the tree; it keeps them, pinned.
        No precondition on ``held``: with worker threads its size depends on timing, and hypothesis
        replays a rule choice only if preconditions do not (``_pick`` draws alike either way)."""
        if (i := _pick(data, self.held)) is None:
            return
        held = self.held[i]
        if not self._loads_ok(held.hit):  # the step that generated a token waited on them
            self._fail(self.held.pop(i))
            return
        hit = self.cache.checkpoint(held.tokens, held.pages, len(held.tokens), held.hit)
        if hit is None:
            return
        assert hit.num_tokens == len(held.tokens) // PS * PS and len(hit.pages) > len(held.hit.pages)
        held.pages[: len(hit.pages)], held.hit = hit.pages, hit
        keys = keys_of(held.tokens, held.salt)[: len(hit.pages)]
        for j in range(1, len(keys) + 1):
            self.computed.add((held.salt, tuple(held.tokens[: j * PS])))
        self.computed_keys.update(keys)

    @rule(data=st.data())
    def serve(self, data) -> None:
        """A few requests arriving together (a conversation's turns, a shared system prompt): their
        prefetches land, one step matches them all in order (every page that arrived is in its
        match) while the loader copies on, and they finish, with no step between. It may come after
        a settle, a flush that left L3 the only copy, or one of L1 only (L2 holds the prefixes, so
        the first match loads them and the next ones split what is loading)."""
        before = data.draw(st.sampled_from(["nothing", "settle", "flush", "flush_l1", "flush_l1"]))
        if before != "nothing":
            self.settle()
        if before == "flush":
            self.flush(settle_first=False)
        if before == "flush_l1":
            self.cache.evict(10**6)
        requests = [self._draw(data) for _ in range(data.draw(st.integers(1, 4)))]
        runs = data.draw(st.lists(st.integers(0, 2), min_size=len(requests), max_size=len(requests)))
        tickets = [self._prefetch(tokens, salt) for tokens, salt in requests]
        for ticket in tickets:
            if ticket is not None:
                self._land(ticket)
                if ticket.host_pages:
                    assert ticket.agreed_arrived == len(ticket.keys), "a prefetch of pages L3 has fell short"
        order = data.draw(st.permutations(range(len(requests))))  # not of those admitted: timing
        batch = []
        for (tokens, salt), ticket, run in zip(requests, tickets, runs, strict=True):
            batch.append(self._serve_one(tokens, salt, ticket))
            self._loader_runs(run)
        for held in (batch[i] for i in order if batch[i] is not None):
            self._finish(held)

    def _serve_one(self, tokens: list[int], salt: str, ticket: Prefetch | None) -> Held | None:
        """Admits one request of ``serve``; its pages a prefetch brought in are kept, unless the
        prefix it extends left the tree meanwhile (an earlier admission's eviction)."""
        held, local = len(self.held), self.cache.tree.cached_pages(tokens[:-1], salt)
        self._admit(tokens, salt, ticket)
        if ticket is not None and local >= ticket.start:
            arrived = min(ticket.agreed_arrived, (len(tokens) - 1) // PS - ticket.start)
            assert self.cache.tree.cached_pages(tokens[:-1], salt) >= ticket.start + arrived, \
                "pages a prefetch brought in were not kept"
        return self.held.pop() if len(self.held) > held else None

    # -- tiers -----------------------------------------------------------------------------------

    @rule(n=st.integers(1, 12))
    def evict_device(self, n: int) -> None:
        """Eviction keeps every page a running request holds; only a failed load takes pages out
        of the tree under its requests (which fail: the engine never runs them again)."""
        failed = [h for h in self.held if any(load.failed for load in h.hit.loads)]
        pinned = {p for h in self.held if h not in failed for p in h.hit.pages}
        self.cache.evict(n)
        assert pinned <= set(self.cache.tree.device_pages()), "a pinned page was evicted"
        kept = set(self.cache.tree.device_pages()) | set(self.cache.loads._orphans)
        assert {p for h in failed for p in h.hit.pages} <= kept, "a failed request's page was evicted"

    @rule(n=st.integers(1, 8))
    def evict_host(self, n: int) -> None:
        self.host.allocator.free(self.cache.tree.evict_host(n))

    @rule(settle_first=st.booleans())
    def flush(self, settle_first: bool) -> None:
        """Evicts all of L1 and L2 that may go (after settling, L3 is left the only copy)."""
        if settle_first:
            self.settle()
        self.cache.evict(10**6)
        self.host.allocator.free(self.cache.tree.evict_host(10**6))
        for node in self.cache.tree.nodes():
            if node.device is not None:
                # a load keeps its nodes until a step agreed it done (``loading`` is cleared then,
                # on the engine thread), not from when its copy finished; ``loads_are_tracked``
                # checks that no node stays ``loading`` after that
                kept = any(m.loading is not None for m in _subtree(node))
                assert node.lock or kept, "flush left an evictable L1 node"
            elif not node.children:
                assert node.lock, "flush left an evictable L2 node"

    @rule(l3=st.booleans(), n=st.integers(1, 4))
    def run_background(self, l3: bool, n: int) -> None:
        """Some queued copies or L3 calls run (threaded: the workers run on their own)."""
        if not self.threaded:
            (self.l3 if l3 else self.io).run(n)

    @rule(layer=st.integers(0, 1))
    def host_copy_fault(self, layer: int) -> None:
        """The next L2 -> L1 load fails while copying ``layer`` (a host-to-device copy error)."""
        self.loader.armed = layer

    @rule()
    def step(self) -> None:
        self.cache.on_step()

    @rule()
    def settle(self) -> None:
        self._drain()
        assert not self.cache._writes and not self.cache.storage._backups
        if self.lossless:  # every L2 page was backed up (or came from L3)
            for node in self.cache.tree.nodes():
                if node.host is not None:
                    assert self.store.present(node.keys) == node.num_pages, "an L2 page never reached L3"

    @rule(down=st.booleans())
    def l3_health(self, down: bool) -> None:
        """L3 goes down, or is back (and the circuit breaker's retry interval passed)."""
        self.store.down = down
        if down:
            self.lossless = False
        else:
            self.cache.storage._down_until = 0.0

    @rule(data=st.data())
    def lose_l3_object(self, data) -> None:
        """L3 drops a page (quota, another node's clear): prefetches must stop at the hole."""
        with self.store._lock:
            keys = sorted(self.store.objects)
            if (i := _pick(data, keys)) is not None:
                del self.store.objects[keys[i]]
                self.lossless = False

    @rule(data=st.data())
    def probe(self, data) -> None:
        """A plain tree match: one contiguous prefix, L1 part then L2 part, of computed pages."""
        tokens, salt = self._draw(data)
        tree = self.cache.tree
        m = tree.match(tokens, salt)
        assert m.num_pages == tree.cached_pages(tokens, salt)
        assert m.num_pages == 0 or (salt, tuple(tokens[: m.num_pages * PS])) in self.computed
        device_path = list(_path(m.device_node))[::-1]
        assert [p for n in device_path for p in n.device] == m.device_pages
        assert [p for n in m.host_nodes for p in n.host] == m.host_pages
        assert all(n.device is None for n in m.host_nodes)
        below = list(_path(m.last_node))[: len(m.host_nodes)][::-1]
        assert below == m.host_nodes and (not below or below[0].parent is m.device_node)

    # -- invariants ------------------------------------------------------------------------------

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
        """A ``loading`` node belongs to a load the cache still tracks: once the load is agreed
        done (or failed) none of its nodes, nor the parts they were split into, stays ``loading``."""
        running = {id(x) for x in self.cache.loads.running}
        for node in self.cache.tree.nodes():
            assert node.loading is None or id(node.loading) in running, "a node stays loading for good"

    @invariant()
    def tree_matches_the_reference(self) -> None:
        """Keys chain along token paths, paths are computed prefixes, L1 nodes hang under L1
        nodes, and every page in L1 or L2 holds its key's KV."""
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
                    if _loaded(node):
                        for p, k in zip(node.device, node.keys, strict=True):
                            assert dev_low[p] == dev_high[p] == value(k), "an L1 page holds other KV"
                if node.host is not None:
                    for p, k in zip(node.host, node.keys, strict=True):
                        assert host_low[p] == host_high[p] == value(k), "an L2 page holds other KV"
                stack += [(c, path, node.keys[-1]) for c in node.children.values()]

    @invariant()
    def only_the_l3_worker_calls_l3(self) -> None:
        if self.threaded:
            lanes = {"hicache-l3-backup_0", "hicache-l3-prefetch_0"}
            assert self.store.callers <= lanes, f"L3 called from {sorted(self.store.callers)}"

    @invariant()
    def l3_holds_only_computed_pages(self) -> None:
        with self.store._lock:
            objects = dict(self.store.objects)
        for key, data in objects.items():
            assert key in self.computed_keys, "L3 holds a page no request computed"
            assert bool((data == value(key)).all()), "an L3 page holds other KV"


def _serve(cache: HiCache, tokens: list[int]) -> Any:
    """One request through the engine's calls, its prefetch allowed to land; returns its hit."""
    ticket = cache.prefetch(tokens)
    deadline = time.monotonic() + 10
    while ticket is not None and not (ticket.decided and (not ticket.host_pages or ticket.agreed_done)):
        assert time.monotonic() < deadline, "a prefetch did not land"
        ticket.done.wait(0.01)  # the L3 worker probes and reads meanwhile
        cache.on_step()
    hit = cache.match(tokens[:-1], ticket)
    for load in hit.loads:
        load.wait(cache.device.geometry.num_layers - 1)
    pages = cache.allocator.alloc(-(-len(tokens) // PS) - len(hit.pages))
    cache.release(tokens, list(hit.pages) + pages, len(tokens), hit)
    return hit


def test_prefetch_keeps_the_l2_prefix_it_extends() -> None:
    geometry = KVGeometry(1, 1, 2, PS, torch.float32)
    host = HostKVPool(geometry, 4, HostLayout.PAGE_FIRST_DIRECT)  # cap: 2 pages for prefetches
    cache = HiCache(PageAllocator(16), DeviceKVPool(geometry, 16, torch.device("cpu")), host, SEED,
                    HiCacheConfig(prefetch=OPTIONS), storage=MemoryStorage())
    a, a_longer, b = [0, 0, 0, 0, 9], [0, 0, 0, 0, 1, 1, 9], [2, 2, 2, 2, 9]
    try:
        _serve(cache, a)
        _serve(cache, a_longer)
        cache.wait_background()  # L3: a's 2 pages and the 1 page after them
        cache.evict(10**6)
        host.allocator.free(cache.tree.evict_host(1))  # L2: a's 2 pages
        _serve(cache, b)
        cache.wait_background()
        cache.evict(10**6)  # L2 full: a's pages (least recently used) and b's
        assert cache.tree.cached_pages(a_longer) == 2
        hit = _serve(cache, a_longer)  # 2 pages in L2, the third in L3
        assert hit.num_tokens == 3 * PS, f"the request found {hit.num_tokens // PS} of 3 pages"
    finally:
        cache.close()


TestL3Machine = L3Machine.TestCase
# long examples: the bugs in loads need a prefix computed, copied to L2, dropped from L1, then loaded
# and split by a match of the same step; 80 x 120 steps found a reverted c4fa60b in 8 of 12 seeds
TestL3Machine.settings = settings(max_examples=80, stateful_step_count=120, deadline=None)


class ThreadedL3Machine(L3Machine):
    """The same rules with the cache's own worker threads doing the copies and L3 calls."""

    threaded = True


TestThreadedL3Machine = ThreadedL3Machine.TestCase
# random examples (seeds 1-8 and 900 more pass); print_blob: with worker threads a failure may not replay
# alike while shrinking, and the blob (@reproduce_failure) retries the example first seen
TestThreadedL3Machine.settings = settings(max_examples=20, stateful_step_count=50, deadline=None, print_blob=True)

