"""Continuous batching with chunked prefill over a paged KV pool.

Each step every running request gets its next tokens (one when decoding, a chunk while its
prompt is being prefilled), then waiting requests are admitted in arrival order while the
prefill budget and free pages last. When a running request needs a page and none is free, the
prefix cache is asked to evict, and failing that the newest running request is preempted: its
pages are released and it waits again at the head of the queue, to be recomputed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.base import PrefixCache, PrefixHit
from tierserve.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """``chunked_prefill_size``: prompt tokens computed per step across requests (the prefill
    budget; decode tokens do not count). ``max_running_requests``: batch size limit."""

    page_size: int
    chunked_prefill_size: int = 2048
    max_running_requests: int = 256


@dataclass
class _Parked:
    """A finished request's pages that a handoff may still read."""

    request: Request
    tokens: list[int]
    pages: list[int]
    num_computed: int
    hit: PrefixHit = field(default_factory=PrefixHit)


@dataclass
class Scheduled:
    """One request's share of a step: compute ``num_tokens`` tokens starting at ``request.num_computed``;
    a decoding request may speculate up to ``draft_tokens`` more (their pages are secured)."""

    request: Request
    num_tokens: int
    draft_tokens: int = 0


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    """Decides what runs each step; owns the waiting queue, the running list and their pages."""

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, cache: PrefixCache,
                 lookahead: Callable[[Request], int] | None = None) -> None:
        """``lookahead``: draft tokens a decoding request would speculate (speculative decoding)."""
        self.config = config
        self.lookahead = lookahead
        self.allocator = allocator
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: list[_Parked] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.prefetch = self.cache.prefetch(request.token_ids(), request.scope)
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def schedule(self) -> list[Scheduled]:
        self.cache.on_step()
        self._unpark()
        budget = self.config.chunked_prefill_size
        batch: list[Scheduled] = []
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            decoding = request.tokens_to_compute() == 1 and request.num_computed > 0
            n = 1 if decoding else min(request.tokens_to_compute(), budget)
            if n and self._grow(request, n):
                batch.append(Scheduled(request, n, self._drafts(request) if decoding else 0))
                budget -= 0 if decoding else n
        self._admit(batch, budget)
        return batch

    def _drafts(self, request: Request) -> int:
        """Draft tokens ``request`` may speculate this step: pages for them are taken (evicting
        cached pages if needed) but never by preempting another request."""
        k = self.lookahead(request) if self.lookahead is not None else 0
        return k if k and self._take_pages(request, request.num_computed + 1 + k) else 0

    def trim(self, request: Request) -> None:
        """Frees the pages past ``request``'s computed tokens (those of rejected draft tokens)."""
        keep = max(pages_for(request.num_computed, self.config.page_size), len(request.hit.pages))
        if len(request.pages) > keep:
            self.allocator.free(request.pages[keep:])
            del request.pages[keep:]

    def release(self, request: Request) -> None:
        """Gives the request's pages back (to the prefix cache, which frees what it does not keep);
        while its handoff may still read them they are parked and given back by a later step."""
        tokens, computed = request.token_ids(), self._cacheable(request)
        if request.handoff is not None and request.handoff.busy():
            self.parked.append(_Parked(request, tokens, request.pages, computed, request.hit))
        else:
            self.cache.release(tokens, request.pages, computed, request.hit)
        request.pages, request.hit = [], PrefixHit()

    def _cacheable(self, request: Request) -> int:
        """Tokens whose KV the cache may keep: with a draft, only those whose draft KV is computed
        too, so every cached page restores both (docs/speculative.md)."""
        return min(request.num_computed, request.draft_computed) if self.lookahead else request.num_computed

    def _unpark(self) -> None:
        for p in [p for p in self.parked if not p.request.handoff.busy()]:
            self.parked.remove(p)
            self.cache.release(p.tokens, p.pages, p.num_computed, p.hit)

    def remove(self, request: Request) -> None:
        """Takes a finished or aborted request out of the queues and releases its pages."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.cancel(request.prefetch)
        request.prefetch = None
        self.release(request)

    def checkpoint(self) -> None:
        """Continuous offload: every running request that generated a token and filled a page
        since its last checkpoint hands its full pages to the cache (``PrefixCache.checkpoint``),
        which lends them back; the page table reads the cache's pages from then on."""
        ps = self.config.page_size
        for r in self.running:
            computed = self._cacheable(r)
            if r.output_ids and computed // ps > len(r.hit.pages):
                hit = self.cache.checkpoint(r.token_ids(), r.pages, computed, r.hit)
                if hit is not None:
                    r.pages[: len(hit.pages)] = hit.pages
                    r.hit = hit

    def _admit(self, batch: list[Scheduled], budget: int) -> None:
        """Admits waiting requests in arrival order, passing over those still prefetching."""
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if not self.cache.ready(request.prefetch):
                continue
            self._match(request)
            n = min(request.tokens_to_compute(), budget)
            if not self._take_pages(request, request.num_computed + n):
                self.release(request)  # unpin the hit while waiting; match again next time
                request.num_computed = 0
                break
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.append(Scheduled(request, n))
            budget -= n

    def _match(self, request: Request) -> None:
        hit = self.cache.match(request.token_ids()[: request.cacheable_prefix()], request.prefetch, request.scope)
        request.prefetch = None
        request.hit, request.pages, request.num_computed = hit, list(hit.pages), hit.num_tokens
        request.draft_computed = hit.num_tokens  # cached pages hold the draft's KV too (``_cacheable``)
        if not request.output_ids:  # a recomputation after preemption keeps its first report
            request.cached_tokens, request.cached_by_tier = hit.num_tokens, dict(hit.by_tier)

    def _grow(self, request: Request, n: int) -> bool:
        """Secures pages for ``n`` more tokens, preempting newer requests if needed; False if the
        request itself had to be preempted."""
        while not self._take_pages(request, request.num_computed + n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _take_pages(self, request: Request, num_tokens: int) -> bool:
        missing = pages_for(num_tokens, self.config.page_size) - len(request.pages)
        if missing <= 0:
            return True
        if self.allocator.num_free < missing:
            self.cache.evict(missing - self.allocator.num_free)
        pages = self.allocator.alloc_after(request.pages, missing)
        while pages is None and self.cache.evict(missing) > 0:  # CP: the owners it needs may still lack pages
            pages = self.allocator.alloc_after(request.pages, missing)
        if pages is None:
            return False
        request.pages.extend(pages)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.release(request)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
