"""The one interface between a prefix cache and the engine and nodes: lending pages already
filled with a prompt's KV (``match``/``release``), and managing the cache (flush, close, KV event
listener and snapshot, L3 admin). The engine and the nodes use only this; see
``docs/cache.md`` for who calls what on which thread."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.events import KVEventListener
from tierserve.core.scope import NO_SCOPE, CacheScope
from tierserve.core.storage import StorageAction, StorageUnavailableError
from tierserve.core.tiers import CacheTier

if TYPE_CHECKING:
    from tierserve.cache.prefetch import PrefetchTicket
    from tierserve.cache.radix_tree import Node
    from tierserve.cache.storage import StorageBackend

Snapshot = list[tuple[bytes, str]]  # (page key, tier) of every page the cache holds, root first


@dataclass
class PrefixHit:
    """The first ``num_tokens`` tokens of a prompt are in ``pages`` (whole pages, read-only).

    ``by_tier`` splits ``num_tokens`` by where the KV came from (device, host, storage);
    ``handle`` is the cache's own bookkeeping (the tree node it pinned; None: nothing pinned),
    returned to it untouched. ``loads`` are copies still filling some of ``pages``, layer by
    layer: attention of layer i must first call ``wait(i)`` on each. ``salt``: the scope's
    (``CacheScope.salt``), under which ``release`` files the pages.
    """

    num_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    by_tier: dict[CacheTier, int] = field(default_factory=dict)
    handle: Node | None = None
    loads: list[LayerLoad] = field(default_factory=list)
    salt: str = ""


class LayerLoad(Protocol):
    """A copy into device pages that completes layer by layer."""

    def wait(self, layer: int) -> None:
        """Blocks until layer ``layer`` is in place (raises if the copy failed)."""
        ...

    def done(self) -> bool: ...

    @property
    def failed(self) -> bool:
        """The copy failed: ``wait`` raises for every layer from now on."""
        ...


class PrefixCache(Protocol):
    """Contract between the engine (and the nodes) and a prefix cache. Every method runs on the
    engine thread, except ``stats`` and ``num_cached_pages`` (read from any thread, approximate).

    Page ownership: pages in a hit belong to the cache and stay pinned until ``release``. The
    engine allocates the request's other pages from the shared ``PageAllocator``; ``release``
    hands all of them to the cache, which keeps what it wants and frees the rest, so after
    ``release`` the engine owns none of the request's pages.
    """

    def prefetch(self, token_ids: Sequence[int], scope: CacheScope = NO_SCOPE,
                 l3_pending: int = 0) -> PrefetchTicket | None:
        """A new request arrived: start fetching its prefix from slower tiers; returns a ticket
        (or None) that the scheduler passes to ``ready``, ``match`` or ``cancel``. ``scope`` (the
        request's tenant and ``cache_salt``) separates namespaces: they never share cached pages.
        ``l3_pending``: the prompt's leading pages another node is writing to L3 now, worth waiting
        for (bounded) rather than recomputing."""
        ...

    def ready(self, ticket: PrefetchTicket | None) -> bool:
        """Whether the request may be scheduled now (its prefetch policy is satisfied)."""
        ...

    def cancel(self, ticket: PrefetchTicket | None) -> None:
        """The request left before ``match``: drop its prefetch."""
        ...

    def match(self, token_ids: Sequence[int], ticket: PrefetchTicket | None = None,
              scope: CacheScope = NO_SCOPE) -> PrefixHit:
        """Longest cached page-aligned prefix of ``token_ids`` in ``scope``, pinned (ends the
        prefetch); the hit remembers the scope's salt for ``release``."""
        ...

    def release(self, token_ids: Sequence[int], pages: list[int], num_computed: int, hit: PrefixHit) -> None:
        """The request is done with ``pages`` (its page table) whose first ``num_computed`` tokens of
        ``token_ids`` hold valid KV; unpins ``hit``."""
        ...

    def checkpoint(self, token_ids: Sequence[int], pages: list[int], num_computed: int,
                   hit: PrefixHit) -> PrefixHit | None:
        """A running request's full computed pages join the cache now (and its slower tiers, as
        the write policy says) while it keeps using them: returns the pinned hit that replaces
        ``hit`` (the request's page table becomes ``hit.pages`` then its own later pages), or None
        when nothing changed. Only the hierarchical cache does it (continuous offload)."""
        ...

    def share(self, token_ids: Sequence[int], pages: list[int], num_full: int, hit: PrefixHit) -> PrefixHit | None:
        """In-flight sharing (docs/cache.md): the first ``num_full`` of a running request's ``pages``
        hold the KV of ``token_ids``' first full pages: they join the cache now, pinned, so later
        requests hit them. Returns the hit that replaces ``hit`` (its pages are ``pages[:num_full]``:
        the page table does not change), or None when nothing changed."""
        ...

    @property
    def shares_in_flight(self) -> bool:
        """Whether ``share`` may share anything (the scheduler holds back a request for a prefix
        another one is computing only then)."""
        ...

    def cached_prefix(self, token_ids: Sequence[int], scope: CacheScope = NO_SCOPE) -> int:
        """How many leading pages of ``token_ids`` a ``match`` would find in L1 or L2 now; pins and
        changes nothing (the longest-prefix-match schedule order)."""
        ...

    def evict(self, num_pages: int) -> int:
        """Frees up to ``num_pages`` unpinned pages to the allocator; returns how many it freed."""
        ...

    def record_compute(self, num_tokens: int, seconds: float) -> None:
        """The engine computed ``num_tokens`` prompt tokens in ``seconds`` (one step): how fast
        recomputing is, against which reading a prefix from a slower tier is weighed."""
        ...

    def on_step(self) -> None:
        """Called by the scheduler before each step: applies finished background work to the
        cache's state, so every change happens at a step boundary on the engine thread."""
        ...

    def stats(self) -> dict[str, float]:
        """Monotonic counters (names ending in ``_total``) and gauges, for metrics."""
        ...

    @property
    def num_cached_pages(self) -> int:
        """Device pages the cache keeps for reuse (no request holds them; freed on demand)."""
        ...

    @property
    def busy(self) -> bool:
        """Background copies are in flight; they finish through ``on_step``, so the engine keeps
        stepping while this is True even with no request."""
        ...

    @property
    def awaits_peers(self) -> bool:
        """This rank finished background work that the ranks have not yet agreed every rank
        finished (another rank is behind): only a step's agreement tells when it catches up."""
        ...

    def flush(self, device: bool, host: bool) -> tuple[int, int]:
        """Drops what L1 (``device``) and/or L2 (``host``) cache and no request holds, after
        waiting for copies in flight; L3 is untouched. Returns the device and host pages freed."""
        ...

    def close(self) -> None:
        """Stops background workers (node shutdown); the cache is not used afterwards."""
        ...

    def set_waker(self, wake: Callable[[], None]) -> None:
        """``wake`` (callable from any thread) is called when background work a waiting request
        depends on ends (an L3 probe or read), so the engine steps then instead of at its next poll."""
        ...

    def set_event_listener(self, listener: KVEventListener) -> bool:
        """Reports every page stored or removed, per tier, to ``listener`` from now on. False
        (and nothing reported) when the cache keeps no prefixes."""
        ...

    def snapshot(self) -> Snapshot:
        """Every page the cache holds now, per tier, parents before children (KV event resync)."""
        ...

    def storage_admin(self, action: StorageAction, backend: StorageBackend | None = None) -> dict[str, Any]:
        """Runtime L3 control: ``STATUS``, ``ATTACH`` (``backend``), ``DETACH``, ``CLEAR``; returns the
        status. Raises ``StorageBusyError`` when the action needs another state (idle, attached,
        detached) and ``StorageUnavailableError`` when the cache has no host tier."""
        ...


class SingleTier:
    """Defaults for caches with one tier (L1 or nothing): no prefetch, no background copies, no
    L3, flush by eviction. Subclasses provide ``match``, ``release``, ``evict``, ``on_step`` and
    ``stats`` (and a tree, if they keep prefixes)."""

    busy = False
    awaits_peers = False
    shares_in_flight = False

    def prefetch(self, token_ids: Sequence[int], scope: CacheScope = NO_SCOPE,
                 l3_pending: int = 0) -> PrefetchTicket | None:
        return None

    def ready(self, ticket: PrefetchTicket | None) -> bool:
        return True

    def cancel(self, ticket: PrefetchTicket | None) -> None:
        pass

    def set_waker(self, wake: Callable[[], None]) -> None:
        pass  # nothing runs in the background

    def evict(self, num_pages: int) -> int:
        return 0

    def checkpoint(self, token_ids: Sequence[int], pages: list[int], num_computed: int,
                   hit: PrefixHit) -> PrefixHit | None:
        return None  # no slower tier to offload to: pages join the cache at release

    def share(self, token_ids: Sequence[int], pages: list[int], num_full: int, hit: PrefixHit) -> PrefixHit | None:
        return None

    def cached_prefix(self, token_ids: Sequence[int], scope: CacheScope = NO_SCOPE) -> int:
        return 0

    def flush(self, device: bool, host: bool) -> tuple[int, int]:
        return (self.evict(sys.maxsize) if device else 0), 0

    def close(self) -> None:
        pass

    def record_compute(self, num_tokens: int, seconds: float) -> None:
        pass

    def set_event_listener(self, listener: KVEventListener) -> bool:
        return False

    def snapshot(self) -> Snapshot:
        return []

    def storage_admin(self, action: StorageAction, backend: StorageBackend | None = None) -> dict[str, Any]:
        if action is StorageAction.STATUS:
            return {"attached": False}
        raise StorageUnavailableError("L3 needs the hierarchical cache (--enable-hierarchical-cache)")


class NoPrefixCache(SingleTier):
    """Caches nothing: every page a request used goes straight back to the allocator."""

    num_cached_pages = 0

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator

    def match(self, token_ids: Sequence[int], ticket: PrefetchTicket | None = None,
              scope: CacheScope = NO_SCOPE) -> PrefixHit:
        return PrefixHit()

    def release(self, token_ids: Sequence[int], pages: list[int], num_computed: int, hit: PrefixHit) -> None:
        self.allocator.free(pages)

    def on_step(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}
