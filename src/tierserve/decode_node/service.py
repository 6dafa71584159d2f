"""``DecodeService``: reserve pages for a prompt a prefill node computes, then generate from them.

Offload to L3 needs no code here: with the hierarchical cache and a storage backend, a finished
request's pages (prompt and answer) go into the tree under the prompt's chained keys, the write
policy copies them to L2 and each L2 copy is backed up to L3, all in the background.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc

from tierserve.core.outputs import RequestOutput
from tierserve.core.sampling import InvalidRequestError
from tierserve.core.tiers import CacheTier
from tierserve.engine.commands import CancelReservation, Reserve
from tierserve.engine.reservations import DEFAULT_TERMS, CapacityError, ReservationTerms
from tierserve.node.convert import arena, identity, kv_ranks, sampling_params
from tierserve.node.server import AddService, Node
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.proto.sampling import logprob_to_proto

log = logging.getLogger(__name__)


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    """``terms`` are the decode role's reservation settings (``--lease-seconds``,
    ``--reservation-grace``, ``--reserve-decode-tokens``); a request may ask for another lease, up
    to ``max_lease_s``."""

    def __init__(self, node: Node, terms: ReservationTerms = DEFAULT_TERMS, max_lease_s: float = 900.0) -> None:
        self.node, self.terms, self.max_lease_s = node, terms, max_lease_s
        self.identity, self.arena = identity(node.engine), arena(node.engine)
        self.arenas = node.ranks.arenas if node.ranks is not None else []  # every rank's arena and heads
        self.receive = node.ranks.receive if node.ranks is not None else None  # rank 0's staging

    async def Reserve(self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext) -> pb.ReserveResponse:
        lease = min(request.lease_seconds or self.terms.lease_s, self.max_lease_s)
        rid, terms = request.request_id, replace(self.terms, lease_s=lease)
        prompt, max_new = list(request.prompt_ids), request.max_new_tokens or 16
        try:
            reserve = Reserve(rid, tuple(prompt), max_new, request.cache_salt, terms, time.monotonic(),
                              request.source_tp_size)
            reserved = await self.node.loop.apply(reserve)  # every rank: the same pages
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CapacityError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        dest = pb.KVDestination(reservation_id=rid, transfer_endpoint=self.node.transfer.endpoint,
                                identity=self.identity, base_address=self.arena.base, num_slots=self.arena.num_slots,
                                pages=reserved.pages, cached_tokens=reserved.num_computed, ranks=self._ranks(rid))
        return pb.ReserveResponse(destination=dest, lease_seconds=terms.lease_s)

    def _ranks(self, rid: str) -> list[pb.KVRank]:
        """Every rank, with the staging the reservation holds on it (at the same offset on every rank)."""
        if self.receive is None:
            return kv_ranks(self.arenas)
        return kv_ranks([replace(a, staged=tuple(self.receive.parts(rid, a.staging_base, a.heads)))
                         for a in self.arenas])

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateChunk]:
        try:
            params = sampling_params(request.sampling)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        stream = self.node.loop.generate_reserved(request.reservation_id, request.first_token, params)
        try:
            async for out in stream:
                yield _chunk(out)
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def GenerateLocal(self, request: pb.LocalGenerateRequest, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[pb.GenerateChunk]:
        """A whole request on this node: its engine computes what its cache lacks of the prompt,
        as a single engine does (conditional disaggregation, ``docs/architecture.md``, the PD path).
        The first chunk carries the cache report (and prompt logprobs when asked)."""
        try:
            params = sampling_params(request.sampling)
            stream = self.node.loop.generate(request.request_id, list(request.prompt_ids), params,
                                             request.cache_salt)
            first = True
            async for out in stream:
                yield _chunk(out, first)
                first = False
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        rid = request.reservation_id
        released = await self.node.loop.apply(CancelReservation(rid, request.writer_stopped, time.monotonic()))
        self.node.loop.abort(rid)  # a running generation ends (aborted) on its stream; else a no-op
        return pb.ReleaseResponse(released=released)


def _chunk(out: RequestOutput, first: bool = False) -> pb.GenerateChunk:
    """An output as a chunk; ``first``: a local generation's first, with the prompt's cache report
    and logprobs."""
    chunk = pb.GenerateChunk(token_ids=out.new_token_ids, text=out.new_text, finished=out.finished,
                             finish_reason=out.reason or "", completion_tokens=out.completion_tokens,
                             logprobs=[logprob_to_proto(lp) for lp in out.logprobs or []])
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
