"""Continuous batching with chunked prefill over a paged KV pool.

Each step every running request gets its next tokens (one when decoding, a chunk while its
prompt is being prefilled), then waiting requests are admitted while the prefill budget and free
pages last: in arrival order (``fcfs``), longest cached prefix first (``lpm``) or by the request's
priority, lower first, then arrival (``priority``, vLLM's convention). When a running request needs a
page and none is free, the prefix cache is asked to evict, and failing that the newest running
request is preempted (under ``priority``: the least important one, newest among equals): its pages
are released and it waits again at the head of the queue, to be recomputed. Under ``priority`` a
waiting request that finds no pages also preempts running requests less important than itself, and
the prompt chunks of running requests less important than the most important waiting one get the
step's prefill budget only after the waiting ones were admitted.

In-flight sharing (docs/cache.md): the full prompt pages a step computed join the prefix cache at
once (``share``), and a waiting request whose prefix a running request is computing right now waits
for those pages (``_held``), at most as many steps as computing that prefix itself would take.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.base import PrefixCache, PrefixHit
from tierserve.engine.config import SchedulePolicy
from tierserve.engine.request import Request, RequestStatus

LPM_MAX_WAITING = 128  # past this queue length ``lpm`` admits in arrival order (SGLang's cut-off too)


@dataclass(frozen=True)
class SchedulerConfig:
    """``chunked_prefill_size``: prompt tokens computed per step across requests (the prefill
    budget; decode tokens do not count). ``max_running_requests``: batch size limit. ``policy``:
    the order waiting requests are admitted in."""

    page_size: int
    chunked_prefill_size: int = 2048
    max_running_requests: int = 256
    policy: SchedulePolicy = SchedulePolicy.LPM


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


def common_pages(a: list[int], b: list[int], page_size: int) -> int:
    """How many leading full pages ``a`` and ``b`` have in common."""
    n, end = 0, min(len(a), len(b)) // page_size
    while n < end and a[n * page_size : (n + 1) * page_size] == b[n * page_size : (n + 1) * page_size]:
        n += 1
    return n


def _prefix(request: Request) -> list[int]:
    """The tokens of ``request`` the prefix cache may serve."""
    return request.token_ids()[: request.cacheable_prefix()]


class Scheduler:
    """Decides what runs each step; owns the waiting queue, the running list and their pages."""

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, cache: PrefixCache,
                 lookahead: Callable[[Request], int] | None = None, draft_kv: bool = False) -> None:
        """``lookahead``: draft tokens a decoding request would speculate (speculative decoding);
        ``draft_kv``: a draft model keeps KV in the same pages (``Request.draft_computed``)."""
        self.config = config
        self.lookahead, self.draft_kv = lookahead, draft_kv
        self.allocator = allocator
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: list[_Parked] = []
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of those, running requests preempted for a more important waiting one
        self.num_held = 0  # request-steps spent waiting for a prefix another request was computing
        self.num_admitted = 0  # requests admitted for the first time, and their seconds from arrival to then
        self.queue_seconds = 0.0

    def add(self, request: Request) -> None:
        request.prefetch = self.cache.prefetch(request.token_ids(), request.scope, request.l3_pending)
        pages = self.cache.cached_prefix(_prefix(request), request.scope)
        request.cached_at_arrival = min(pages * self.config.page_size, request.num_tokens - 1)
        self.waiting.append(request)

    def backlog(self) -> dict[int, int]:
        """Prompt tokens still to compute, by priority (``LoadReport.prefill_backlog``): a waiting
        request's all but what the cache held when it arrived (a preempted one's: all), a running
        one's until its prompt is done; decoding requests none."""
        out: dict[int, int] = {}
        for request in self.waiting:
            held = request.cached_at_arrival if request.admitted_at is None else 0
            out[request.params.priority] = out.get(request.params.priority, 0) + request.num_tokens - held
        for request in self.running:
            if request.num_computed < len(request.prompt_ids):
                out[request.params.priority] = out.get(request.params.priority, 0) + request.tokens_to_compute()
        return out

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def schedule(self) -> list[Scheduled]:
        self.cache.on_step()
        self._unpark()
        budget = self.config.chunked_prefill_size
        batch: list[Scheduled] = []
        deferred: list[Request] = []
        urgent = self._most_important_waiting()
        for request in self._by_importance(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            decoding = request.tokens_to_compute() == 1 and request.num_computed > 0
            if not decoding and urgent is not None and request.params.priority > urgent:
                deferred.append(request)  # its next chunk waits for the more important admissions
                continue
            n = 1 if decoding else min(request.tokens_to_compute(), budget)
            if n and self._grow(request, n):
                batch.append(Scheduled(request, n, self._drafts(request) if decoding else 0))
                budget -= 0 if decoding else n
        budget = self._admit(batch, budget)
        self._continue(deferred, batch, budget)
        return batch

    def _most_important_waiting(self) -> int | None:
        """Under ``priority``, the most important waiting request's priority: running prompts less
        important than it get the prefill budget only after the waiting requests were admitted
        (their pages stay theirs meanwhile). None otherwise, or with nothing waiting."""
        if self.config.policy is not SchedulePolicy.PRIORITY or not self.waiting:
            return None
        return min(r.params.priority for r in self.waiting)

    def _continue(self, deferred: list[Request], batch: list[Scheduled], budget: int) -> None:
        """The deferred running prompts' next chunks, within the budget left; pages for them are
        taken (evicting cached ones) but never by preempting: the batch is already made."""
        for request in deferred:
            n = min(request.tokens_to_compute(), budget)
            if request.status is RequestStatus.RUNNING and n and self._take_pages(request, request.num_computed + n):
                batch.append(Scheduled(request, n))
                budget -= n

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
            self.share(request)  # visible to other requests while its handoff reads the pages
            self.parked.append(_Parked(request, tokens, request.pages, computed, request.hit))
        else:
            self.cache.release(tokens, request.pages, computed, request.hit)
        request.pages, request.hit = [], PrefixHit()

    def share(self, request: Request) -> None:
        """In-flight sharing: ``request``'s computed full prompt pages join the prefix cache now,
        pinned by it (``PrefixCache.share``); its page table does not change. Called after a step
        that computed prompt tokens, at the same point on every rank (docs/ranks.md)."""
        full = min(self._cacheable(request), len(request.prompt_ids)) // self.config.page_size
        if full > len(request.hit.pages):
            hit = self.cache.share(request.token_ids(), request.pages, full, request.hit)
            if hit is not None:
                request.hit = hit

    def _cacheable(self, request: Request) -> int:
        """Tokens whose KV the cache may keep: with a draft, only those whose draft KV is computed
        too, so every cached page restores both (docs/speculative.md)."""
        return min(request.num_computed, request.draft_computed) if self.draft_kv else request.num_computed

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

    def _admit(self, batch: list[Scheduled], budget: int) -> int:
        """Admits waiting requests in ``_order``, passing over those still prefetching and those
        held for a prefix another request is computing; returns the budget left."""
        if budget <= 0 or len(self.running) >= self.config.max_running_requests:
            return budget
        for request in self._order():
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if not self.cache.ready(request.prefetch):
                continue
            request.ready_at = request.ready_at or time.monotonic()
            if self._held(request):
                continue
            self._match(request)
            n = min(request.tokens_to_compute(), budget)
            if not self._room(request, request.num_computed + n, batch):
                self.release(request)  # unpin the hit while waiting; match again next time
                request.num_computed = 0
                break
            self.waiting.remove(request)
            self._count_queued(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.append(Scheduled(request, n))
            budget -= n
        return budget

    def _count_queued(self, request: Request) -> None:
        """Arrival to first admission (an L3 prefetch's wait included), for ``/metrics``; a
        preempted request's second wait is the scheduler's doing, not queueing, so it is not counted.
        Wall time: only rank 0's counts are exported; no decision depends on it."""
        if request.queued_s is None:
            request.queued_s = time.monotonic() - request.arrival
            self.num_admitted += 1
            self.queue_seconds += request.queued_s

    def _order(self) -> list[Request]:
        """The waiting requests in the order to admit them: ``lpm``, the most pages already cached
        first (ties, and queues over ``LPM_MAX_WAITING``, in queue order); ``fcfs``, queue order;
        ``priority``, lower priority values first, ties in queue order. Tree state and request
        settings only, so every rank orders alike."""
        waiting = list(self.waiting)
        if self.config.policy is SchedulePolicy.PRIORITY:
            return self._by_importance(waiting)
        if self.config.policy is not SchedulePolicy.LPM or not 1 < len(waiting) <= LPM_MAX_WAITING:
            return waiting
        return sorted(waiting, key=lambda r: -self.cache.cached_prefix(_prefix(r), r.scope))

    def _held(self, request: Request) -> bool:
        """Whether ``request`` waits (this step) for pages of its prefix that a running request is
        computing now and has not yet shared: held at most as many steps in all as computing that
        prefix itself would take (``chunked_prefill_size`` tokens a step), then it computes it."""
        if not self.cache.shares_in_flight:
            return False
        tokens = _prefix(request)
        coming = max((self._coming(tokens, request.scope.salt, r) for r in self.running), default=0)
        if not coming or request.held_steps >= pages_for(coming * self.config.page_size,
                                                          self.config.chunked_prefill_size):
            return False
        request.held_steps += 1
        self.num_held += 1
        return True

    def _coming(self, tokens: list[int], salt: str, sharer: Request) -> int:
        """Full pages of ``tokens`` that ``sharer`` (running) computes and will share but has not yet
        (0 if none): the pages they have in common, when more than ``sharer`` already shared."""
        prompt = sharer.prompt_ids
        if sharer.num_computed >= len(prompt) or sharer.scope.salt != salt or tokens[:1] != prompt[:1]:
            return 0
        common = common_pages(tokens, prompt, self.config.page_size)
        return common if common > len(sharer.hit.pages) else 0

    def _match(self, request: Request) -> None:
        if request.admitted_at is None:  # its first admission (traces, docs/tracing.md)
            request.admitted_at = time.monotonic()
            request.prefetch_at = request.prefetch.created if request.prefetch is not None else None
        hit = self.cache.match(request.token_ids()[: request.cacheable_prefix()], request.prefetch, request.scope)
        request.prefetch = None
        request.hit, request.pages, request.num_computed = hit, list(hit.pages), hit.num_tokens
        request.draft_computed = hit.num_tokens  # cached pages hold the draft's KV too (``_cacheable``)
        if not request.output_ids:  # a recomputation after preemption keeps its first report
            request.cached_tokens, request.cached_by_tier = hit.num_tokens, dict(hit.by_tier)

    def _by_importance(self, requests: list[Request]) -> list[Request]:
        """``requests`` most important first under ``priority`` (a stable sort: ties keep their
        order), else as they are."""
        if self.config.policy is not SchedulePolicy.PRIORITY:
            return list(requests)
        return sorted(requests, key=lambda r: r.params.priority)

    def _victim(self) -> Request:
        """The running request to preempt first: the newest; under ``priority`` the least important,
        newest among equals (running is never empty here)."""
        if self.config.policy is not SchedulePolicy.PRIORITY:
            return self.running[-1]
        return max(reversed(self.running), key=lambda r: r.params.priority)

    def _grow(self, request: Request, n: int) -> bool:
        """Secures pages for ``n`` more tokens, preempting newer (``priority``: less important)
        requests if needed; False if the request itself had to be preempted."""
        while not self._take_pages(request, request.num_computed + n):
            victim = self._victim()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _room(self, request: Request, num_tokens: int, batch: list[Scheduled]) -> bool:
        """Pages for ``request``'s first ``num_tokens`` tokens before it is admitted; under ``priority``
        running requests less important than it are preempted for them (taken out of this step's
        ``batch``), as vLLM's priority scheduling does. False: it waits."""
        while not self._take_pages(request, num_tokens):
            if self.config.policy is not SchedulePolicy.PRIORITY or not self.running:
                return False
            victim = self._victim()
            if victim.params.priority <= request.params.priority or (victim.handoff and victim.handoff.busy()):
                return False  # nothing less important, or its pages are being sent: they would not come back now
            self._preempt(victim)
            batch[:] = [s for s in batch if s.request is not victim]
            self.num_priority_preemptions += 1
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
