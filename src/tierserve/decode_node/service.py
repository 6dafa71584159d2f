"""``DecodeService``: reserve pages for a prompt a prefill node computes, then generate from them.

Offload to L3 needs no code here: with the hierarchical cache and a storage backend, each page a
running request fills (continuous offload, ``EngineConfig.offload_generated``) and at the end the
rest of its pages go into the tree under the prompt's chained keys, the write policy copies them to
L2 and each L2 copy is backed up to L3, all in the background.

Drain (SIGTERM, docs/migration.md): new reservations and generations are refused
(``UNAVAILABLE``), running ones stop, their pages reach L3, then their streams end with
``UNAVAILABLE`` and the trailer ``DRAINING``, so the router continues them elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc

from tierserve.core.outputs import FinishReason, RequestOutput
from tierserve.core.sampling import InvalidRequestError
from tierserve.core.scope import CacheScope
from tierserve.core.tiers import CacheTier
from tierserve.engine.commands import CancelReservation, FlushCache, Reserve
from tierserve.engine.handoff import HandoffCheckError
from tierserve.engine.reservations import DEFAULT_TERMS, CapacityError, ReservationTerms
from tierserve.node.convert import arena, identity, kv_ranks, sampling_params
from tierserve.node.server import AddService, Node
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.proto.sampling import logprob_to_proto
from tierserve.proto.trailers import DRAINING, flag  # the trailer the router reads
from tierserve.tracing import Span
from tierserve.tracing import attributes as at
from tierserve.tracing.engine_spans import traced
from tierserve.transfer.receive_check import ReceiveCheck, ScatterFence

log = logging.getLogger(__name__)


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    """``terms`` are the decode role's reservation settings (``--lease-seconds``,
    ``--reservation-grace``, ``--reserve-decode-tokens``); a request may ask for another lease, up
    to ``max_lease_s``."""

    def __init__(self, node: Node, terms: ReservationTerms = DEFAULT_TERMS, max_lease_s: float = 900.0) -> None:
        self.node, self.terms, self.max_lease_s = node, terms, max_lease_s
        self.integrity = node.ranks is not None and node.ranks.integrity  # --handoff-integrity: digests required
        self.identity, self.arena = identity(node.engine), arena(node.engine)
        self.arenas = node.ranks.arenas if node.ranks is not None else []  # every rank's arena, heads, draft pool
        self.itemsize = node.engine.geometry.dtype.itemsize
        self.receive = node.ranks.receive if node.ranks is not None else None  # rank 0's staging
        self.running: set[str] = set()  # reservation ids of the generations streaming now
        self.draining, self._handed_back = False, asyncio.Event()
        node.drain.append(self.drain)
        node.sessions.forget.append(self.forget)

    async def Reserve(self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext) -> pb.ReserveResponse:
        """Traced, the call is a span under the router's, with what this node holds of the prompt."""
        attrs = at.request(request.request_id, request.tenant, len(request.prompt_ids))
        with self.node.tracer.server("tierserve.v1.DecodeService/Reserve", context.invocation_metadata(), attrs
                                     ) as span:
            response = await self._reserve(request, context)
            if span.recording:
                span.set({at.CACHED_TOKENS: response.destination.cached_tokens})
            return response

    async def _reserve(self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext) -> pb.ReserveResponse:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode node is draining")
        lease = min(request.lease_seconds or self.terms.lease_s, self.max_lease_s)
        rid, terms = request.request_id, replace(self.terms, lease_s=lease)
        prompt, max_new = list(request.prompt_ids), request.max_new_tokens or 16
        try:
            reserve = Reserve(rid, tuple(prompt), max_new, CacheScope.of(request), terms, time.monotonic(),
                              request.source_tp_size)
            reserved = await self.node.loop.apply(reserve)  # every rank: the same pages
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CapacityError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        self.node.sessions.own(request.router_id, rid)  # its router's lost session ends it
        dest = pb.KVDestination(reservation_id=rid, transfer_endpoint=self.node.transfer.endpoint,
                                identity=self.identity, base_address=self.arena.base, num_slots=self.arena.num_slots,
                                pages=reserved.pages, cached_tokens=reserved.num_computed, ranks=self._ranks(rid))
        return pb.ReserveResponse(destination=dest, lease_seconds=terms.lease_s)

    async def forget(self, ids: list[str]) -> None:
        """A lost router's requests (``node/sessions.py``): its reservations end (their pages wait out
        the grace: a prefill node may still be writing) and its generations are aborted."""
        for rid in ids:
            await self.node.loop.apply(CancelReservation(rid, False, time.monotonic()))
            self.node.loop.abort(rid)

    def _ranks(self, rid: str) -> list[pb.KVRank]:
        """Every rank, with the staging the reservation holds on it (at the same offset on every rank)."""
        if self.receive is None:
            return kv_ranks(self.arenas, self.itemsize)
        return kv_ranks([replace(a, staged=tuple(self.receive.parts(rid, a.staging_base, a.heads, a.arena.num_layers)))
                         for a in self.arenas], self.itemsize)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateChunk]:
        """Traced, the call is a span under the router's, with the wait for the engine, the first
        token and the decode under it."""
        rid, since = request.reservation_id, time.monotonic()
        attrs = at.request(rid, request.tenant)
        with self.node.tracer.server("tierserve.v1.DecodeService/Generate", context.invocation_metadata(), attrs
                                     ) as span:
            async with contextlib.aclosing(self._generate(request, context, span, since)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, span: Span,
                        since: float) -> AsyncIterator[pb.GenerateChunk]:
        try:
            params = sampling_params(request.sampling)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self.draining:
            await self._hand_back(context)
        check = self._check(request)
        if isinstance(check, str):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, check)
        stream = traced(span, self.node.loop.generate_reserved(request.reservation_id, request.first_token, params,
                                                               request.resumed_tokens, check), since)
        self.running.add(request.reservation_id)
        owner = self.node.sessions.owner(request.reservation_id)  # Reserve tied it to its router
        try:
            async for chunk in self._chunks(request.reservation_id, stream, context):
                yield chunk
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except HandoffCheckError as exc:
            self.node.metrics.handoff_integrity_failures.inc()
            log.warning("request %s: %s: refused, its pages freed", request.reservation_id, exc)
            await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
        finally:
            self.running.discard(request.reservation_id)
            self.node.sessions.disown(owner, request.reservation_id)

    async def _chunks(self, rid: str, stream: AsyncIterator[RequestOutput], context: grpc.aio.ServicerContext,
                      local: bool = False) -> AsyncIterator[pb.GenerateChunk]:
        """``stream``'s outputs as chunks (``local``: the first with the prompt's cache report); a
        drain ends it with the ``DRAINING`` trailer once its pages are on their way to L3."""
        first = local
        async for out in stream:
            if self.draining and out.finish_reason is FinishReason.ABORT:
                await self._hand_back(context)
            if self.draining and not out.finished:  # started as the drain began, after its aborts
                self.node.loop.abort(rid)
            yield _chunk(out, first)
            first = False

    async def drain(self) -> None:
        """SIGTERM: refuses new work, stops every running generation (its pages go to the cache,
        which copies them on to L3), waits until the copies in flight landed, then lets the
        streams end with the ``DRAINING`` trailer."""
        self.draining = True
        running = list(self.running)
        log.info("draining: handing %d running request(s) back to the router", len(running))
        for rid in running:
            self.node.loop.abort(rid)
        try:  # queued after the aborts, so it waits for the copies their releases start
            await self.node.loop.apply(FlushCache(device=False, host=False))
        finally:
            self._handed_back.set()

    async def _hand_back(self, context: grpc.aio.ServicerContext) -> None:
        await self._handed_back.wait()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode node is draining",
                            trailing_metadata=(flag(DRAINING, True),))

    def _check(self, request: pb.GenerateRequest) -> ReceiveCheck | ScatterFence | str | None:
        """The digests' check of the KV that arrived (``--handoff-integrity``, a collective); a message
        when this node requires digests and the request has none; without digests, at several ranks,
        a ``ScatterFence`` for a reservation whose writers staged (rank 0's regions say which: every
        rank holds the same ones)."""
        if request.kv_digests:
            return ReceiveCheck(tuple(request.kv_digests))
        if self.integrity:
            return "this decode node checks KV digests (--handoff-integrity) and the request has none: " \
                   "start the prefill node with --handoff-integrity too"
        if len(self.arenas) > 1 and self.receive is not None and self.receive.holds(request.reservation_id):
            return ScatterFence()
        return None

    async def GenerateLocal(self, request: pb.LocalGenerateRequest, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[pb.GenerateChunk]:
        """A whole request on this node: its engine computes what its cache lacks of the prompt,
        as a single engine does (conditional disaggregation, ``docs/pd.md``).
        The first chunk carries the cache report (and prompt logprobs when asked). Traced, the call
        is a span under the router's, with the engine's spans under it."""
        attrs = at.request(request.request_id, request.tenant, len(request.prompt_ids))
        with self.node.tracer.server("tierserve.v1.DecodeService/GenerateLocal", context.invocation_metadata(),
                                     attrs) as span:
            async with contextlib.aclosing(self._local(request, context, span)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def _local(self, request: pb.LocalGenerateRequest, context: grpc.aio.ServicerContext, span: Span
                     ) -> AsyncIterator[pb.GenerateChunk]:
        if self.draining:
            await self._hand_back(context)
        rid = request.request_id
        self.running.add(rid)
        try:
            with self.node.sessions.tie(request.router_id, rid):
                params = sampling_params(request.sampling)
                outputs = self.node.loop.generate(rid, list(request.prompt_ids), params, CacheScope.of(request))
                stream = traced(span, outputs)
                async for chunk in self._chunks(rid, stream, context, local=True):
                    yield chunk
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            self.running.discard(rid)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        rid = request.reservation_id
        self.node.sessions.disown(self.node.sessions.owner(rid), rid)
        released = await self.node.loop.apply(CancelReservation(rid, request.writer_stopped, time.monotonic()))
        self.node.loop.abort(rid)  # a running generation ends (aborted) on its stream; else a no-op
        return pb.ReleaseResponse(released=released)


def _chunk(out: RequestOutput, first: bool = False) -> pb.GenerateChunk:
    """An output as a chunk; ``first``: a local generation's first, with the prompt's cache report
    and logprobs."""
    chunk = pb.GenerateChunk(token_ids=out.new_token_ids, text=out.new_text, finished=out.finished,
                             finish_reason=out.reason or "", completion_tokens=out.completion_tokens,
                             logprobs=[logprob_to_proto(lp) for lp in out.logprobs or []],
                             spec_draft_tokens=out.spec_draft_tokens, spec_accepted_tokens=out.spec_accepted_tokens)
    if first:
        tiers = out.cached_by_tier
        chunk.cache.CopyFrom(pb.CacheReport(cached_tokens=out.cached_tokens, **{t.value: tiers.get(t, 0)
                                                                               for t in CacheTier}))
        chunk.prompt_logprobs.extend(logprob_to_proto(lp) for lp in out.prompt_logprobs or [] if lp)
    return chunk


def add_decode_service(terms: ReservationTerms, max_lease_s: float) -> AddService:
    """The ``AddService`` hook of ``run_node`` for the decode role."""

    def add(server: grpc.aio.Server, node: Node) -> str:
        pb_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(node, terms, max_lease_s), server)
        return "tierserve.v1.DecodeService"

    return add
