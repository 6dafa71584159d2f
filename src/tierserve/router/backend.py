"""The router's ``Backend``: each request through a prefill/decode pair (``docs/pd.md``), with admission control,
deadlines, an idle deadline on decode streams, retries on a new pair while the request produced nothing, migration to
another pair once it did (``router/migration.py``), and load counted until the stream ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import astuple, dataclass, field, replace
from typing import Any, TypeVar

import grpc

from tierserve.api import openai as oa
from tierserve.api.backend import Sibling
from tierserve.core.outputs import FinishReason, RequestOutput, TokenLogprob
from tierserve.core.sampling import InvalidRequestError, SamplingParams
from tierserve.core.scope import CacheScope
from tierserve.core.tiers import TIERS
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto.sampling import logprob_from_proto, to_proto
from tierserve.router import pd_flow
from tierserve.router.disaggregation import (
    DEFAULT_THRESHOLD,
    Disaggregation,
    LocalOutputs,
    ServedPath,
    alone_output,
    generate_local,
    prefill_alone,
    uncached_tokens,
)
from tierserve.router.migration import DecodeLost, LostReason, Migrations, draining, migrating
from tierserve.router.policies import CachedPrefix, Policy, PrefixLookup, fitting
from tierserve.router.registry import Registry, Worker
from tierserve.router.roles import Role
from tierserve.router.slots import PrioritySlots
from tierserve.router.ttft import L3LookupFactory, TTFTView
from tierserve.tracing import NO_SPAN, Span, current_span
from tierserve.tracing import attributes as at

log = logging.getLogger(__name__)
T = TypeVar("T")
PrefixLookupFactory = Callable[[list[int], str], Callable[[Worker], CachedPrefix]]
_Pair = tuple[Worker | None, Worker | None]  # (prefill, decode); either alone serves the request (``ServedPath``)


@dataclass(frozen=True)
class RouterOptions:
    max_running: int = 256  # requests in flight through the router
    max_queued: int = 1024  # waiting for a slot; beyond that: 429
    timeout_s: float = 600.0  # a prefill leg's deadline (compute plus KV handoff)
    max_retries: int = 2  # new pairs tried while a try produced nothing
    backoff_s: float = 0.05  # first retry's base delay, doubled each time, with jitter
    stream_idle_timeout_s: float = 30.0  # a decode stream with no chunk for this long is given up
    max_migrations: int = 2  # times a request that produced tokens continues on another pair
    disaggregation_threshold: int = DEFAULT_THRESHOLD  # fewer uncached prompt tokens: the decode node prefills
    disaggregation_spill_priority: int | None = None  # this important or more: prefilled there when P is backed up


@dataclass(frozen=True)
class _Request:
    id: str
    prompt: list[int]
    sampling: pb.SamplingOptions
    scope: CacheScope  # the API key's tenant and the client's salt: the cache namespace, on the nodes too
    buffered: bool  # the client sees nothing before the end (one merged output)
    resumed: int = 0  # the prompt's last tokens this request generated before a migration
    l3_pending: int = 0  # one try's: leading prompt pages another prefill node holds (``_pending_in_l3``)
    uncached: int = 0  # one try's: prompt tokens the node computing it does not hold (its TTFT lane counts them)
    lead: asyncio.Future[object] | None = None  # a leading choice's: where its siblings learn its decode node
    fork: Worker | None = None  # a sibling choice's: the decode node holding its leader's prompt KV
    span: Span = NO_SPAN  # the choice's span (docs/tracing.md); one try's: that try's
    arrived: float = field(default_factory=time.monotonic)  # its deadline (``sampling.deadline_ms``) runs from here


class PDBackend:
    """Requests through prefill/decode pairs. Errors: 400 for what a node says is invalid, 429
    when the admission queue is full, 503 when no healthy pair exists or every try failed, 502
    (decode failed) or 504 (decode silent) once a request that produced tokens may not migrate again."""

    def __init__(self, registry: Registry, prefill: Policy, decode: Policy, options: RouterOptions,
                 max_model_len: int, lookup: PrefixLookupFactory | None = None,
                 warm: Callable[[], bool] | None = None, l3_lookup: L3LookupFactory | None = None) -> None:
        """``warm``: whether the routing view is complete enough to take traffic (the KV index
        synced: ``CacheView.synced``); readiness waits for it. ``l3_lookup``: the prompt's pages in
        L3 after a worker's own (``CacheView.l3_lookup``), for the TTFT prediction."""
        self.registry, self.prefill_policy, self.decode_policy = registry, prefill, decode
        self.warm = warm or (lambda: True)
        self.options, self.max_model_len = options, max_model_len
        self.lookup = lookup or (lambda tokens, salt: lambda worker: CachedPrefix())
        self._slots = PrioritySlots(options.max_running)
        self.retries = 0
        self.migrations = Migrations()
        self.disaggregation = Disaggregation(options.disaggregation_threshold, options.disaggregation_spill_priority)
        self.served = {path: 0 for path in ServedPath}  # tries started per path
        self.spilled = 0  # of the decode_only tries, those the prefill nodes' backlog sent there (``_spills``)
        self.forks = 0  # sibling choices sent to their leader's decode node (docs/pd.md, n choices)
        self.routes: deque[dict[str, object]] = deque(maxlen=256)  # recent decisions, for operators and tests
        self.ttft = TTFTView(registry, self.lookup, self.disaggregation, l3_lookup)  # admission by predicted TTFT

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return self._slots.waiting

    def healthy(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.registry.ready() and self.warm()

    async def debug_state(self) -> dict[str, Any]:
        return {"workers": [w.describe() for w in self.registry.listed()], "queued": self.queued,
                "retries": self.retries, "served": {p.value: n for p, n in self.served.items()},
                "spilled": self.spilled, "forks": self.forks,
                "routes": list(self.routes), "lanes": self.ttft.state()} | self.migrations.state()

    def predict_ttft(self, prompt_ids: list[int], params: SamplingParams, scope: CacheScope) -> float | None:
        """The best worker's prediction (``router/ttft.py``); requests waiting for one of this router's
        slots are not counted ahead."""
        return self.ttft.predict(prompt_ids, params.priority, scope.salt)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, scope: CacheScope,
                       *, buffered: bool = False, sibling: Sibling | None = None) -> AsyncIterator[RequestOutput]:
        """``buffered``: see ``Backend``; such a request gets one output, when it finished (after
        any migrations). ``sibling``: one of a prompt's ``n`` choices; the leader (choice 0) goes
        through a pair, the others wait for its prompt KV on its decode node and run there
        (``_follow``; docs/pd.md, n choices)."""
        lead = sibling.group.lead() if sibling is not None else None
        span = current_span().child("tierserve.choice", attrs=at.request(request_id, scope.tenant, len(prompt_ids)))
        arrived = time.monotonic()
        try:
            with span:
                # a follower takes its slot first: admission answers as for n requests
                async with self._slot(span, params.priority):
                    request = _Request(request_id, prompt_ids, to_proto(params), scope, buffered, span=span,
                                       arrived=arrived)
                    request = await self._choice(request, sibling, lead)
                    tries = migrating(self._attempts, request, self.options.max_migrations, self.migrations)
                    async with contextlib.aclosing(_merged(tries) if buffered else tries) as outputs:
                        async for out in outputs:
                            yield out
        finally:
            if sibling is not None and sibling.index == 0:
                _settle(lead, None)  # the leader ended (failed, cancelled) before its KV reached a decode node

    @contextlib.asynccontextmanager
    async def _slot(self, span: Span, priority: int) -> AsyncIterator[None]:
        """One of ``max_running`` slots, held for the block (``_admit``; its wait is ``span``'s child);
        waiting requests get them by ``priority`` (``router/slots.py``)."""
        with span.child("tierserve.admission", attrs={"tierserve.queued": self.queued}):
            await self._admit(priority)
        try:
            yield
        finally:
            self._slots.release()

    async def _choice(self, request: _Request, sibling: Sibling | None, lead: asyncio.Future[object] | None
                      ) -> _Request:
        """``request`` as a choice: a leader carries where it tells its siblings its decode node,
        a follower the decode node it is forked to (None: its own way)."""
        if sibling is None:
            return request
        return replace(request, lead=lead) if sibling.index == 0 else replace(request, fork=await self._follow(lead))

    async def _follow(self, lead: asyncio.Future[object] | None) -> Worker | None:
        """The decode node holding the leader's prompt KV, once its first output came (it is then
        in that node's tree: ``Engine.start_reserved``); None when the leader failed before, went
        nowhere a follower can go, or took longer than a prefill leg's deadline: the follower
        then goes its own way, as a request of its own."""
        if lead is None:
            return None
        with contextlib.suppress(TimeoutError):
            decode = await asyncio.wait_for(asyncio.shield(lead), self.options.timeout_s)
            if isinstance(decode, Worker) and decode in self.registry.available(Role.DECODE):
                return decode
        return None

    async def _admit(self, priority: int) -> None:
        if self._slots.locked() and self.queued >= self.options.max_queued:
            raise oa.APIError(429, "the server is overloaded: too many requests waiting; retry later",
                              code="overloaded")
        await self._slots.acquire(priority)

    async def _attempts(self, request: _Request) -> AsyncIterator[RequestOutput]:
        """Tries pairs until one serves the request. A failed pair uses up a retry; a decode node
        with no room (a burst) does not: the request waits with backoff, up to its deadline, as in
        a queue. Each decision is logged once, with its reason and the pair. A forked sibling's first
        try goes to its leader's decode node (``_forked``), its later ones their own way."""
        last_error, failures, attempt = "no attempt", 0, 0
        deadline = asyncio.get_running_loop().time() + self.options.timeout_s
        while failures <= self.options.max_retries:
            if attempt:
                self.retries += 1
                await asyncio.sleep(self._backoff(attempt, deadline))
            attempt += 1
            fork = request.fork if attempt == 1 and not request.resumed else None  # later tries: its own way
            with request.span.child("tierserve.attempt", attrs={at.REQUEST_ID: request.id, at.ATTEMPT: attempt}
                                    ) as span:
                pair, tried = self._routed(fork, request, span)
                try:
                    async with contextlib.aclosing(self._attempt(pair, replace(tried, span=span), attempt)) as outputs:
                        async for out in outputs:
                            yield out
                    return
                except _Retry as exc:
                    _settle(request.lead, None)  # a leader's KV reached no decode node: its siblings go their own way
                    last_error = str(exc)
                    failures += 0 if exc.busy and asyncio.get_running_loop().time() < deadline else 1
                    span.fail(last_error)
                    _log_retry(request.id, pair, exc, again=failures <= self.options.max_retries)
        raise oa.APIError(503, f"no prefill/decode pair could serve the request: {last_error}", code="unavailable")

    def _routed(self, fork: Worker | None, request: _Request, span: Span) -> tuple[_Pair, _Request]:
        """The try's pair (``_forked`` or ``_pick``), its decision a ``tierserve.route`` span under ``span``."""
        started = time.monotonic()
        pair, tried = self._forked(fork, request) if fork is not None else self._pick(request)
        if span.recording:
            span.record("tierserve.route", started, time.monotonic(), _route_attrs(self.routes[-1], self._page()))
        return pair, tried

    def _page(self) -> int:
        return self.registry.info.identity.page_size if self.registry.info is not None else 1

    async def _attempt(self, pair: _Pair, request: _Request, attempt: int) -> AsyncIterator[RequestOutput]:
        """One try on one pair (or one node alone), counted in the workers' load until it ends."""
        prefill, decode = pair
        if decode is None:
            _settle(request.lead, None)  # a one-token leader: nothing for its siblings to decode from
        used = [w for w in pair if w is not None]
        for worker in used:
            worker.begin()
        try:
            rid = f"{request.id}-{attempt}"
            request = _remaining(request)
            if prefill is None:
                outputs = self._local(decode, rid, request)
            elif decode is None:
                outputs = self._alone(prefill, rid, request)
            else:
                outputs = self._disaggregated((prefill, decode), rid, request)
            outputs = self.ttft.track(prefill or decode, rid, request.uncached, request.sampling.priority, outputs)
            first = request.span.recording
            async with contextlib.aclosing(outputs) as results:
                async for out in results:
                    if first:  # the cache report of what this try's nodes actually held
                        request.span.set(at.cached(out.cached_tokens, out.cached_by_tier))
                        first = False
                    _settle(request.lead, decode)  # its first output: the prompt's KV is in decode's tree
                    yield out
        finally:
            for worker in used:
                worker.end()

    async def _disaggregated(self, pair: tuple[Worker, Worker], rid: str, request: _Request
                             ) -> AsyncIterator[RequestOutput]:
        stubs, done = await self._prefill(pair, rid, request)

        def convert(chunk: pb.GenerateChunk, first: bool) -> RequestOutput:
            return _output(done, len(request.prompt), chunk, request.sampling, first)

        def release() -> None:
            pd_flow.release_later(stubs, done.reservation_id, writer_stopped=True)

        chunks = pd_flow.generate(stubs, done, request.sampling, request.resumed, request.span,
                                  request.scope.tenant)
        outputs = self._stream(pair[1], chunks, convert, release)
        async with contextlib.aclosing(outputs) as results:
            async for out in results:
                yield out

    def _local(self, decode: Worker, rid: str, request: _Request) -> AsyncIterator[RequestOutput]:
        """The whole request on the decode node (``GenerateLocal``): cancelling the stream aborts
        it there, so a failure needs no Release."""
        chunks = generate_local(decode.channel, rid, request.prompt, request.sampling, request.scope,
                                self.registry.router_id, request.span)
        convert = LocalOutputs(rid, len(request.prompt), request.sampling).output
        return self._stream(decode, chunks, convert, None)

    async def _alone(self, prefill: Worker, rid: str, request: _Request) -> AsyncIterator[RequestOutput]:
        """A one-token request on the prefill node alone: its first token is the answer."""
        try:
            response = await prefill_alone(prefill.channel, rid, request.prompt, request.sampling, request.scope,
                                           self.options.timeout_s, request.l3_pending, self.registry.router_id,
                                           request.span)
        except grpc.aio.AioRpcError as exc:
            self._blame(prefill, exc.code(), exc.details() or "")
            raise _Retry(f"prefill on {prefill.address}: {exc.code().name} {exc.details()}") from exc
        self.registry.succeeded(prefill)
        yield alone_output(rid, len(request.prompt), response, request.sampling)

    def _backoff(self, attempt: int, deadline: float) -> float:
        """Jittered exponential delay, at most 1 s and never past the deadline."""
        delay = min(1.0, self.options.backoff_s * 2 ** min(attempt - 1, 10)) * (0.5 + random.random())
        return max(0.0, min(delay, deadline - asyncio.get_running_loop().time()))

    def _forked(self, decode: Worker, request: _Request) -> tuple[_Pair, _Request]:
        """A sibling choice's first try: the whole request on its leader's decode node
        (``GenerateLocal``), which holds the prompt's full pages: it computes at most the last
        partial page and the last token, and samples its own first token."""
        self.served[ServedPath.DECODE_ONLY] += 1
        self.forks += 1
        route = {"path": ServedPath.DECODE_ONLY.value, "fork": True, "decode": decode.address,
                 "prompt_tokens": len(request.prompt)}
        self.routes.append(route)
        log.debug("route: %s", route)
        full_pages = CachedPrefix(device=len(request.prompt) // self._page())
        return (None, decode), replace(request, uncached=uncached_tokens(len(request.prompt), full_pages, self._page()))

    def _pick(self, request: _Request) -> tuple[_Pair, _Request]:
        """The decode worker, then the path (``Disaggregation``: what the decode worker holds of
        the prompt, the tokens asked for), then the prefill worker if the path has one; and the
        request as this try sends it (the pages it may find arriving in L3)."""
        prefills, decodes = self.registry.available(Role.PREFILL), self.registry.available(Role.DECODE)
        if not decodes:
            raise oa.APIError(503, "no healthy decode worker", code="unavailable")
        lookup = self.lookup(request.prompt, request.scope.salt)
        decode = self.decode_policy.pick(fitting(decodes, len(request.prompt) + request.sampling.max_tokens), lookup)
        held = lookup(decode)
        page = self.registry.info.identity.page_size if self.registry.info is not None else 1
        # a migrated request continues its text (``resumed``), which only the PD path's Generate carries
        path = ServedPath.PREFILL_DECODE if request.resumed else \
            self.disaggregation.path(len(request.prompt), held, page, request.sampling.max_tokens, decode.cp_size)
        route = {"path": path.value, "decode": decode.address, "prompt_tokens": len(request.prompt),
                 "decode_cached_pages": [held.device, held.host]}
        if path is not ServedPath.DECODE_ONLY and not prefills:
            raise oa.APIError(503, "no healthy prefill worker", code="unavailable")
        prefill = self.prefill_policy.pick(prefills, lookup) if path is not ServedPath.DECODE_ONLY else None
        if path is ServedPath.PREFILL_DECODE and not request.resumed and self._spills(decode, prefill, request):
            path, prefill = ServedPath.DECODE_ONLY, None
            route |= {"path": path.value, "spilled": True}
            self.spilled += 1
        self.served[path] += 1
        request = replace(request, uncached=uncached_tokens(len(request.prompt), held, page))
        if prefill is not None:
            cached = lookup(prefill)
            request = replace(request, l3_pending=_pending_in_l3(prefill, cached, prefills, lookup),
                              uncached=uncached_tokens(len(request.prompt), cached, page))
            route |= {"prefill": prefill.address, "prefill_cached_pages": [cached.device, cached.host],
                      "l3_pending_pages": request.l3_pending}
        self.routes.append(route)
        log.debug("route: %s", route)
        return (prefill, None if path is ServedPath.PREFILL_ONLY else decode), request

    def _spills(self, decode: Worker, prefill: Worker, request: _Request) -> bool:
        """Whether the decode node prefills this prompt itself because the prefill nodes are backed up
        (``--disaggregation-spill-priority``, ``TTFTView.spills``); never a migrated request (the caller
        checks: only the PD path's ``Generate`` carries ``resumed``)."""
        priority = request.sampling.priority
        return self.disaggregation.may_spill(priority) and \
            self.ttft.spills(decode, prefill, request.prompt, priority, request.scope.salt)

    async def _prefill(self, pair: tuple[Worker, Worker], rid: str, request: _Request
                       ) -> tuple[pd_flow.Pair, pd_flow.Prefilled]:
        prefill, decode = pair
        stubs = pd_flow.Pair.connect(prefill.channel, decode.channel)
        try:
            done = await pd_flow.prefill(stubs, rid, request.prompt, request.sampling, request.scope,
                                         self.options.timeout_s, prefill.info.tp_size if prefill.info else 0,
                                         request.l3_pending, self.registry.router_id, request.span)
        except pd_flow.HandoffFailed as exc:  # a transfer into a dead or frozen D is D's failure, not P's
            self._blame(decode if exc.destination_failed else prefill, exc.code, str(exc))
            raise _Retry(f"prefill on {prefill.address}: {exc}") from exc
        except grpc.aio.AioRpcError as exc:  # Reserve failed
            self._blame(decode, exc.code(), exc.details() or "")
            busy = exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            raise _Retry(f"reserve on {decode.address}: {exc.code().name} {exc.details()}", busy) from exc
        self.registry.succeeded(prefill)
        return stubs, done

    def _blame(self, worker: Worker, code: grpc.StatusCode, message: str) -> None:
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.OUT_OF_RANGE):
            raise InvalidRequestError(message)  # the request, not the worker: no retry
        if code is not grpc.StatusCode.RESOURCE_EXHAUSTED:  # a full worker is healthy, just busy
            self.registry.failed(worker, code.name, unreachable=code is grpc.StatusCode.UNAVAILABLE)

    async def _stream(self, decode: Worker, chunks: AsyncIterator[pb.GenerateChunk],
                      convert: Callable[[pb.GenerateChunk, bool], RequestOutput],
                      release: Callable[[], None] | None) -> AsyncIterator[RequestOutput]:
        """D's chunks as outputs (``convert(chunk, first)``). D failing, draining, or sending nothing
        for ``stream_idle_timeout_s`` (frozen, cut off), blames D, cancels the stream (D aborts it
        and frees its pages), calls ``release`` (which does not wait: a dead, stopping or frozen D
        answers late or never) and ends the try: ``_Retry`` while it produced nothing, else
        ``DecodeLost``. D refusing the request (a local generation's own checks) is the request's
        error, not D's; KV that failed its digests (DATA_LOSS) is the pair's, retried, D not blamed."""
        produced = False
        chunks = _within(chunks, self.options.stream_idle_timeout_s)
        try:
            async with contextlib.aclosing(chunks):
                async for i, chunk in _numbered(chunks):
                    produced = True
                    yield convert(chunk, i == 0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequestError(exc.details() or "") from exc
            if exc.code() is not grpc.StatusCode.DATA_LOSS:
                self.registry.failed(decode, exc.code().name, unreachable=exc.code() is grpc.StatusCode.UNAVAILABLE)
            if release is not None:
                release()
            reason = LostReason.DRAINING if draining(exc) else LostReason.FAILED
            raise _decode_failed(decode, produced, f"{reason.value} ({exc.code().name} {exc.details()})", 502,
                                 reason) from exc
        except _Stalled as exc:
            self.registry.failed(decode, "stream idle", unreachable=True)  # back once a health check passes
            if release is not None:
                release()
            raise _decode_failed(decode, produced, str(exc), 504, LostReason.SILENT) from exc
        self.registry.succeeded(decode)


def _decode_failed(decode: Worker, produced: bool, what: str, status: int, reason: LostReason) -> Exception:
    """A try that produced nothing is retried; otherwise the request migrates (``DecodeLost``,
    carrying the error its client gets if it may not)."""
    if not produced:
        return _Retry(f"generate on {decode.address}: {what}")
    error = oa.APIError(status, f"decode worker {decode.address} {what} mid-stream", code="decode_failed")
    return DecodeLost(decode.address, reason, error)


def _remaining(request: _Request) -> _Request:
    """``request`` as a try sends it: its deadline shortened by the time it already waited here, so
    a node measures it from when the call reaches it (at least 1 ms: a late one is still late there);
    none for a migrated request, whose first token the client already has."""
    if not request.sampling.HasField("deadline_ms"):
        return request
    sampling = pb.SamplingOptions()
    sampling.CopyFrom(request.sampling)
    waited_ms = int((time.monotonic() - request.arrived) * 1000)
    sampling.deadline_ms = max(1, request.sampling.deadline_ms - waited_ms)
    if request.resumed:
        sampling.ClearField("deadline_ms")
    return replace(request, sampling=sampling)


def _settle(lead: asyncio.Future[object] | None, decode: Worker | None) -> None:
    """Tells a leader's siblings, once, where its prompt KV is (None: nowhere they can use)."""
    if lead is not None and not lead.done():
        lead.set_result(decode)


def _pending_in_l3(chosen: Worker, cached: CachedPrefix, prefills: Sequence[Worker], lookup: PrefixLookup) -> int:
    """The prompt's leading pages another prefill node holds (L1 and L2) beyond what ``chosen``
    does (``cached``): under write-through that node is writing them to L3, or has, so ``chosen`` may
    wait for them there rather than compute them (``docs/cache.md``, "Backups in flight"); 0 if none
    holds more."""
    own = sum(astuple(cached))
    most = max((sum(astuple(lookup(w))) for w in prefills if w is not chosen), default=0)
    return most if most > own else 0


def _route_attrs(route: dict[str, object], page: int) -> dict[str, str | int | bool]:
    """A routing decision (``PDBackend.routes``) as span attributes: the path, the nodes, and the
    cached prompt tokens the router expects on each node by tier (its KV-event index; storage: the
    pages another prefill node is writing to L3)."""
    attrs: dict[str, str | int | bool] = {"tierserve.path": str(route["path"]),
                                          "tierserve.fork": bool(route.get("fork"))}
    for role in ("prefill", "decode"):
        if role not in route:
            continue
        attrs[f"tierserve.{role}_node"] = str(route[role])
        device, host = route.get(f"{role}_cached_pages", (0, 0))  # type: ignore[misc]
        storage = route.get("l3_pending_pages", 0) if role == "prefill" else 0
        for tier, pages in (("device", device), ("host", host), ("storage", storage)):
            attrs[f"{at.PREDICTED_CACHED}.{role}.{tier}"] = int(pages) * page  # type: ignore[call-overload]
    return attrs


def _log_retry(request_id: str, pair: _Pair, exc: _Retry, again: bool) -> None:
    """One line per decision; a decode node that is only full is routine (a burst), not a fault."""
    level = logging.INFO if exc.busy else logging.WARNING
    prefill, decode = (w.address if w is not None else "none" for w in pair)
    log.log(level, "request %s: prefill %s / decode %s: %s; %s", request_id, prefill, decode, exc,
            "retrying on a new pair" if again else "giving up")


async def _numbered(items: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    i = 0
    async for item in items:
        yield i, item
        i += 1


def _output(done: pd_flow.Prefilled, prompt_len: int, chunk: pb.GenerateChunk, sampling: pb.SamplingOptions,
            first: bool) -> RequestOutput:
    """D's chunk as an output; the first one (P's first token) gets P's logprobs of it and of the prompt."""
    cache = done.response.cache
    return RequestOutput(
        request_id=done.reservation_id, new_token_ids=list(chunk.token_ids), new_text=chunk.text,
        finished=chunk.finished, finish_reason=FinishReason(chunk.finish_reason) if chunk.finished else None,
        prompt_tokens=prompt_len, completion_tokens=chunk.completion_tokens, cached_tokens=cache.cached_tokens,
        cached_by_tier={t: getattr(cache, t) for t in TIERS if getattr(cache, t)},
        logprobs=_logprobs(done, chunk, first) if sampling.HasField("logprobs") else None,
        prompt_logprobs=_prompt_logprobs(done, prompt_len) if first and sampling.HasField("prompt_logprobs") else None,
        spec_draft_tokens=chunk.spec_draft_tokens, spec_accepted_tokens=chunk.spec_accepted_tokens,
    )


def _logprobs(done: pd_flow.Prefilled, chunk: pb.GenerateChunk, first: bool) -> list[TokenLogprob]:
    head = [logprob_from_proto(done.response.first_logprob)] if first else []
    return head + [logprob_from_proto(lp) for lp in chunk.logprobs]


def _prompt_logprobs(done: pd_flow.Prefilled, prompt_len: int) -> list[TokenLogprob | None]:
    """P scored the prompt's last tokens: those before them have no logprob."""
    scored = [logprob_from_proto(lp) for lp in done.response.prompt_logprobs]
    return [None] * (prompt_len - len(scored)) + scored


async def _merged(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """A try's outputs as one, once it finished (nothing if it yielded none)."""
    parts = [out async for out in outputs]
    if parts:
        logprobs = [lp for p in parts for lp in p.logprobs or []] if parts[0].logprobs is not None else None
        yield replace(parts[-1], new_token_ids=[t for p in parts for t in p.new_token_ids],
                      new_text="".join(p.new_text for p in parts), logprobs=logprobs,
                      prompt_logprobs=parts[0].prompt_logprobs)


async def _within(items: AsyncIterator[T], idle_s: float) -> AsyncIterator[T]:
    """``items`` while each comes within ``idle_s`` of the one before; else raises ``_Stalled``
    (cancelling the wait closes ``items``, here a gRPC stream, which cancels the call)."""
    async with contextlib.aclosing(items):
        while True:
            try:
                async with asyncio.timeout(idle_s):
                    item = await anext(items)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise _Stalled(f"sent nothing for {idle_s:g} s") from None
            yield item


class _Retry(Exception):
    """This pair failed before the client saw anything: try another. ``busy``: the worker was only
    full, not broken."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


class _Stalled(Exception):
    """A decode stream sent nothing for the idle timeout."""
