"""``PrefillService``: compute a prompt (with HiCache hits), stream its KV into the decode node's
reserved pages layer by layer, and answer the first token with the cache report."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

import grpc

from tierserve.core.outputs import RequestOutput
from tierserve.core.sampling import InvalidRequestError, SamplingParams
from tierserve.core.scope import CacheScope
from tierserve.core.tiers import CacheTier
from tierserve.engine.commands import AddRequest, EngineCommand
from tierserve.node.convert import (
    destination_ranks,
    heads_problem,
    identity,
    identity_mismatch,
    sampling_params,
    sidecar_problem,
    staging_problem,
)
from tierserve.node.handoffs import HandoffAdd
from tierserve.node.rank_transfer import HandoffPlan
from tierserve.node.server import AddService, Node
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.proto.sampling import logprob_to_proto
from tierserve.proto.trailers import DESTINATION_FAILED, WRITER_STOPPED, flag  # the trailers the router reads
from tierserve.tracing import Span
from tierserve.tracing import attributes as at
from tierserve.tracing.engine_spans import record_prefill
from tierserve.transfer.faulty import NO_FAULTS, HandoffFaults
from tierserve.transfer.handoff import HandoffResult
from tierserve.transfer.layout import RankArena
from tierserve.transfer.sender import SenderHandoff

log = logging.getLogger(__name__)


CONFIRM_STOP_S = 0.5  # a failed Prefill waits this long for its in-flight batches, to confirm they ended


@dataclass(frozen=True)
class PrefillOptions:
    """``timeout_s`` bounds compute plus handoff when the request gives none. ``faults``, for fault
    tests only, make handoffs fail, lag or write wrong bytes (``transfer/faulty.py``; they come from
    the tests' fault file, never a flag: ``injected_handoff_faults``)."""

    timeout_s: float = 60.0
    faults: HandoffFaults = NO_FAULTS


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, node: Node, options: PrefillOptions = PrefillOptions()) -> None:
        self.node, self.options = node, options
        self.identity = identity(node.engine)
        self.metrics = node.metrics
        node.sessions.forget.append(self.forget)

    async def forget(self, ids: list[str]) -> None:
        """A lost router's prefills (``node/sessions.py``) are aborted; their handoffs stop."""
        for rid in ids:
            self.node.loop.abort(rid)

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        """Computes the prompt and hands its KV over; a failure says in its trailing metadata
        whether the handoff's batches all ended (``WRITER_STOPPED``). Tied to the router that
        asked while it runs (aborted if that router is lost, ``node/sessions.py``). Traced, the call is a
        span under the router's (its ``traceparent``), with the engine's and the handoff's under it."""
        attrs = at.request(request.request_id, request.tenant, len(request.prompt_ids))
        with self.node.tracer.server("tierserve.v1.PrefillService/Prefill", context.invocation_metadata(), attrs
                                     ) as span, self.node.sessions.tie(request.router_id, request.request_id):
            if not request.HasField("destination"):
                return await self._alone(request, context, span)
            return await self._prefill(request, context, span)

    async def _prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext, span: Span
                       ) -> pb.PrefillResponse:
        prompt, dest = list(request.prompt_ids), request.destination
        problem = self._check_destination(prompt, dest)
        if problem is not None:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, problem, stopped=True)
        try:
            params = _first_token_params(sampling_params(request.sampling))
        except InvalidRequestError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), stopped=True)
        handoff, add = self._handoff(request, prompt, params, self._plan(prompt, dest))
        timeout = request.timeout_seconds or self.options.timeout_s
        try:
            first, result = await self._run(add, handoff, timeout)
        except InvalidRequestError as exc:  # refused on every rank before any KV was computed: nothing sent
            handoff.cancel(str(exc))
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), stopped=True)
        except TimeoutError:
            self.metrics.handoffs.labels("deadline").inc()
            await self._fail(context, handoff, grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"prefill and KV handoff took over {timeout:.1f} s")
        finally:
            if handoff.busy():  # aborted, failed or timed out: stop sending; in-flight batches still end
                handoff.cancel("the prefill ended before the handoff")
        return await self._answer(context, request.request_id, first, result, handoff, span)

    def _plan(self, prompt: list[int], dest: pb.KVDestination) -> HandoffPlan:
        dests = destination_ranks(dest, self.node.ranks.head_bytes)
        return HandoffPlan(tuple(dests), tuple(dest.pages), dest.cached_tokens, len(prompt))

    def _drafts(self) -> list[RankArena]:
        """This node's ranks' sidecar draft pools (none without a sidecar draft)."""
        return [a.draft for a in self.node.ranks.arenas if a.draft is not None]

    def _handoff(self, request: pb.PrefillRequest, prompt: list[int], params: SamplingParams, plan: HandoffPlan
                 ) -> tuple[SenderHandoff, EngineCommand]:
        """This rank's handoff and the command that adds the request: at several ranks every rank
        builds its own handoff from the plan and they agree on when all ended (``node/handoffs.py``)."""
        ranks, opts = self.node.ranks, self.options
        add = AddRequest(request.request_id, tuple(prompt), params, CacheScope.of(request),
                         l3_pending=request.l3_pending_pages)
        if ranks.board is None:
            handoff = ranks.handoff(plan, opts.faults)
            return handoff, replace(add, handoff=handoff)
        agreed = ranks.agreed(plan, opts.faults)
        return agreed, HandoffAdd(replace(add, plan=plan), agreed)

    async def _run(self, add: EngineCommand, handoff: SenderHandoff, timeout: float
                   ) -> tuple[RequestOutput | None, HandoffResult]:
        """Compute, then the rest of the handoff, within ``timeout`` seconds together."""
        deadline = time.monotonic() + timeout
        first = await asyncio.wait_for(self._compute(add), timeout)
        if not handoff.busy():  # done with the compute, as a short prompt's usually is: no thread hop
            return first, handoff.result(0.0)
        return first, await asyncio.to_thread(handoff.result, max(0.0, deadline - time.monotonic()))

    async def _alone(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext, span: Span
                     ) -> pb.PrefillResponse:
        """A one-token request served here alone (no decode node, no handoff): the router's
        prefill-only path (``docs/pd.md``). The request's own sampling
        settings hold, so EOS ends it as on a single engine."""
        try:
            params = sampling_params(request.sampling)
            if params.max_tokens != 1:
                raise InvalidRequestError("a Prefill without a destination serves max_tokens 1 only")
            add = AddRequest(request.request_id, tuple(request.prompt_ids), params, CacheScope.of(request),
                             l3_pending=request.l3_pending_pages)
            first = await asyncio.wait_for(self._compute(add), request.timeout_seconds or self.options.timeout_s)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the prefill took too long")
        if first is None or not first.new_token_ids:
            await context.abort(grpc.StatusCode.ABORTED, "the prefill was aborted")
        record_prefill(span, first)
        return _response(first, text=first.new_text, finish_reason=first.reason or "")

    async def _fail(self, context: grpc.aio.ServicerContext, handoff: SenderHandoff,
                    code: grpc.StatusCode, message: str) -> None:
        """Stops the handoff, waits a moment for its in-flight batches, and aborts saying whether they ended."""
        if handoff.busy():
            handoff.cancel(message)
        stopped = await asyncio.to_thread(handoff.wait_stopped, CONFIRM_STOP_S)
        await _abort(context, code, message, stopped, handoff.peer_failed)

    async def _compute(self, add: EngineCommand) -> RequestOutput | None:
        first = None
        async for out in self.node.loop.stream(add):
            first = out
        return first

    async def _answer(self, context: grpc.aio.ServicerContext, request_id: str, first: RequestOutput | None,
                      result: HandoffResult, handoff: SenderHandoff, span: Span) -> pb.PrefillResponse:
        if result.error is None and (first is None or not first.new_token_ids):
            result.error = "the prefill was aborted"
        if result.error is not None:
            self.metrics.handoffs.labels("failed").inc()
            log.warning("request %s: KV handoff failed: %s", request_id, result.error)
            await self._fail(context, handoff, grpc.StatusCode.ABORTED, f"KV handoff failed: {result.error}")
        self.metrics.handoffs.labels("ok").inc()
        self.metrics.transfer_bytes.inc(result.bytes)
        self.metrics.transfer_seconds.observe(result.transfer_seconds)
        self.metrics.exposed_seconds.observe(result.exposed_seconds)
        log.debug("request %s: handoff %d bytes in %.3f s (%.3f s after compute), cached %d", request_id,
                 result.bytes, result.transfer_seconds, result.exposed_seconds, first.cached_tokens)
        _record_handoff(span, first, result)
        return _response(first, transferred_bytes=result.bytes, transfer_seconds=result.transfer_seconds,
                         exposed_transfer_seconds=result.exposed_seconds, kv_digests=result.digests)

    def _check_destination(self, prompt: list[int], dest: pb.KVDestination) -> str | None:
        mismatch = identity_mismatch(self.identity, dest.identity)
        if mismatch is not None:
            return mismatch
        page = self.identity.page_size
        if not prompt:
            return "the prompt is empty"
        if len(dest.pages) * page < len(prompt):
            return f"the destination holds {len(dest.pages) * page} tokens, the prompt has {len(prompt)}"
        if dest.cached_tokens >= len(prompt) or dest.cached_tokens % page:
            return f"cached_tokens {dest.cached_tokens} must be a multiple of {page} below the prompt length"
        dests = destination_ranks(dest, self.node.ranks.head_bytes)
        i = self.identity
        return heads_problem(dests, i.num_kv_heads, max(dest.pages), i.num_layers) or \
            sidecar_problem([d.draft for d in dests if d.draft is not None], self._drafts(), max(dest.pages)) or \
            staging_problem(dests, i.num_kv_heads, self.node.engine.ranks.tp.size, len(prompt), dest.pages)


def _record_handoff(span: Span, first: RequestOutput, result: HandoffResult) -> None:
    """The engine's spans, then ``tierserve.kv_handoff``: its last transfer ended ``exposed_seconds``
    after the compute (the first token), its first began ``transfer_seconds`` before that."""
    computed = record_prefill(span, first)
    if computed is None:
        return
    ended = computed + result.exposed_seconds
    span.record("tierserve.kv_handoff", ended - result.transfer_seconds, ended, {
        at.HANDOFF_BYTES: result.bytes, at.HANDOFF_TRANSFER_S: result.transfer_seconds,
        at.HANDOFF_EXPOSED_S: result.exposed_seconds})


def _response(first: RequestOutput, **fields: object) -> pb.PrefillResponse:
    """The first token, its cache report and logprobs, plus ``fields``."""
    tiers = first.cached_by_tier
    cache = pb.CacheReport(cached_tokens=first.cached_tokens, **{t.value: tiers.get(t, 0) for t in CacheTier})
    return pb.PrefillResponse(first_token=first.new_token_ids[0], cache=cache,
                              first_logprob=logprob_to_proto(first.logprobs[0]) if first.logprobs else None,
                              prompt_logprobs=[logprob_to_proto(lp) for lp in first.prompt_logprobs or [] if lp],
                              **fields)


def _first_token_params(params: SamplingParams) -> SamplingParams:
    """The prefill node samples the first token only: no stop strings; EOS ends nothing here,
    but stays masked when ``min_tokens`` asks for at least one token."""
    return replace(params, max_tokens=1, stop=[], min_tokens=min(params.min_tokens, 1),
                   ignore_eos=params.ignore_eos or not params.min_tokens)


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, stopped: bool,
                 destination_failed: bool = False) -> None:
    await context.abort(code, message, trailing_metadata=(flag(WRITER_STOPPED, stopped),
                                                          flag(DESTINATION_FAILED, destination_failed)))


def add_prefill_service(options: PrefillOptions) -> AddService:
    """The ``AddService`` hook of ``run_node`` for the prefill role."""

    def add(server: grpc.aio.Server, node: Node) -> str:
        pb_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(node, options), server)
        return "tierserve.v1.PrefillService"

    return add
