"""The hook through which a prefix cache lends the engine pages already filled with a prompt's KV."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tierserve.cache.allocator import PageAllocator


@dataclass
class PrefixHit:
    """The first ``num_tokens`` tokens of a prompt are in ``pages`` (whole pages, read-only).

    ``by_tier`` splits ``num_tokens`` by where the KV came from (device, host, storage);
    ``handle`` is the cache's own bookkeeping, returned to it untouched. ``loads`` are copies
    still filling some of ``pages``, layer by layer: attention of layer i must first call
    ``wait(i)`` on each.
    """

    num_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    by_tier: dict[str, int] = field(default_factory=dict)
    handle: object = None
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
    """Contract between the engine and a prefix cache.

    Page ownership: pages in a hit belong to the cache and stay pinned until ``release``. The
    engine allocates the request's other pages from the shared ``PageAllocator``; ``release``
    hands all of them to the cache, which keeps what it wants and frees the rest, so after
    ``release`` the engine owns none of the request's pages.
    """

    def prefetch(self, token_ids: Sequence[int], salt: str = "") -> object | None:
        """A new request arrived: start fetching its prefix from slower tiers; returns a ticket
        (or None) that the scheduler passes to ``ready``, ``match`` or ``cancel``. ``salt`` (the
        request's ``cache_salt``) separates tenants: they never share cached pages."""
        ...

    def ready(self, ticket: object | None) -> bool:
        """Whether the request may be scheduled now (its prefetch policy is satisfied)."""
        ...

    def cancel(self, ticket: object | None) -> None:
        """The request left before ``match``: drop its prefetch."""
        ...

    def match(self, token_ids: Sequence[int], ticket: object | None = None, salt: str = "") -> PrefixHit:
        """Longest cached page-aligned prefix of ``token_ids``, pinned (ends the prefetch); the
        hit remembers ``salt`` for ``release``."""
        ...

    def release(self, token_ids: Sequence[int], pages: list[int], num_computed: int, hit: PrefixHit) -> None:
        """The request is done with ``pages`` (its page table) whose first ``num_computed`` tokens of
        ``token_ids`` hold valid KV; unpins ``hit``."""
        ...

    def evict(self, num_pages: int) -> int:
        """Frees up to ``num_pages`` unpinned pages to the allocator; returns how many it freed."""
        ...

    def on_step(self) -> None:
        """Called by the scheduler before each step: applies finished background work to the
        cache's state, so every change happens at a step boundary on the engine thread."""
        ...

    def stats(self) -> dict[str, float]:
        """Monotonic counters (names ending in ``_total``) and gauges, for metrics."""
        ...

    @property
    def busy(self) -> bool:
        """Background copies are in flight; they finish through ``on_step``, so the engine keeps
        stepping while this is True even with no request."""
        ...


class NoPrefetch:
    """For caches with no slower tier to prefetch from (and so no background copies)."""

    busy = False

    def prefetch(self, token_ids: Sequence[int], salt: str = "") -> object | None:
        return None

    def ready(self, ticket: object | None) -> bool:
        return True

    def cancel(self, ticket: object | None) -> None:
        pass


class NoPrefixCache(NoPrefetch):
    """Caches nothing: every page a request used goes straight back to the allocator."""

    num_cached_pages = 0

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator

    def match(self, token_ids: Sequence[int], ticket: object | None = None, salt: str = "") -> PrefixHit:
        return PrefixHit()

    def release(self, token_ids: Sequence[int], pages: list[int], num_computed: int, hit: PrefixHit) -> None:
        self.allocator.free(pages)

    def evict(self, num_pages: int) -> int:
        return 0

    def on_step(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}
