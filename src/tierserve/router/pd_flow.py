"""One request through a prefill/decode pair (``docs/pd.md``):
Reserve on D, Prefill on P, Generate on D. Any failure releases the reservation at once, and so
does a cancellation of the caller (a client gone, a sibling choice failed, a timeout), even one
that comes while Reserve is in flight; the caller decides whether to retry on a new pair. No
torch here: the router imports this."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from tierserve.core.scope import NO_SCOPE, CacheScope
from tierserve.core.tiers import TIERS
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.proto.trailers import DESTINATION_FAILED, WRITER_STOPPED, says
from tierserve.tracing import NO_SPAN, Span, SpanKind
from tierserve.tracing import attributes as at

LEASE_MARGIN_S = 2.0  # the prefill leg ends this long before the decode node's lease runs out
RELEASE_TIMEOUT_S = 5.0  # one Release call
RELEASE_RETRY_S = 120.0  # a Release D did not answer is sent again, with backoff, this long

log = logging.getLogger(__name__)
T = TypeVar("T")
# Clean-ups that must outlive a cancelled caller; asyncio keeps only weak references to tasks.
_background: set[asyncio.Future] = set()


class HandoffFailed(RuntimeError):
    """The prefill leg failed (compute, transfer or deadline); ``code`` is its gRPC status;
    ``destination_failed``: P says the transfer into D failed (D dead, frozen or cut off), so D
    is to blame, not P."""

    def __init__(self, code: grpc.StatusCode, message: str, destination_failed: bool = False) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.destination_failed = code, destination_failed


@dataclass
class Pair:
    """Channels to one prefill node and one decode node."""

    prefill: pb_grpc.PrefillServiceStub
    decode: pb_grpc.DecodeServiceStub

    @classmethod
    def connect(cls, prefill: grpc.aio.Channel, decode: grpc.aio.Channel) -> Pair:
        return cls(pb_grpc.PrefillServiceStub(prefill), pb_grpc.DecodeServiceStub(decode))


@dataclass
class Prefilled:
    """A reservation whose prompt KV is in place, ready to generate."""

    reservation_id: str
    response: pb.PrefillResponse


async def prefill(pair: Pair, request_id: str, prompt_ids: list[int], sampling: pb.SamplingOptions,
                  scope: CacheScope = NO_SCOPE, timeout_s: float = 60.0, source_tp: int = 0,
                  l3_pending: int = 0, router_id: str = "", span: Span = NO_SPAN) -> Prefilled:
    """Reserve on D then Prefill on P; releases the reservation on any failure and raises
    ``HandoffFailed`` or the gRPC error. ``source_tp``: P's TP size (``NodeInfo.tp_size``; 0 if
    unknown), so D can stage what P's ranks write when they hold fewer heads than D's. ``scope``
    (the API key's tenant, the client's salt) is sent to both nodes, which file the pages under it.
    ``l3_pending``: the prompt's leading pages another node is writing to L3 (``PrefillRequest``).
    ``router_id``: this router's, tying the reservation and the prefill to its sessions with the
    nodes, which free them if it dies (``router/sessions.py``).
    ``span``: the try's; each call is a client span under it, whose ``traceparent`` the call carries.

    The deadlines form one chain (``docs/faults.md``): D grants a lease for the
    whole leg (it may grant less than asked), P's deadline ends ``LEASE_MARGIN_S`` before that
    lease, and D frees the pages at once only when P confirmed that its last batch ended; any
    other ending makes D quarantine them for its grace period, longer than any transfer."""
    with span.child("tierserve.v1.DecodeService/Reserve", SpanKind.CLIENT) as call:
        reserved = await _reserve(pair, pb.ReserveRequest(
            request_id=request_id, prompt_ids=prompt_ids, max_new_tokens=sampling.max_tokens,
            cache_salt=scope.cache_salt, tenant=scope.tenant, lease_seconds=timeout_s + LEASE_MARGIN_S,
            source_tp_size=source_tp, router_id=router_id,
        ), timeout_s, call.headers())
    dest = reserved.destination
    deadline = min(timeout_s, reserved.lease_seconds - LEASE_MARGIN_S)
    if deadline <= 0:
        await release(pair, dest.reservation_id, writer_stopped=True)
        raise HandoffFailed(grpc.StatusCode.ABORTED, f"the decode node granted a {reserved.lease_seconds:.1f} s "
                                                     f"lease: too short for a prefill")
    call = span.child("tierserve.v1.PrefillService/Prefill", SpanKind.CLIENT)
    try:
        with call:
            response = await pair.prefill.Prefill(pb.PrefillRequest(
                request_id=request_id, prompt_ids=prompt_ids, sampling=sampling, cache_salt=scope.cache_salt,
                tenant=scope.tenant, destination=dest, timeout_seconds=deadline, l3_pending_pages=l3_pending,
                router_id=router_id,
            ), timeout=deadline + LEASE_MARGIN_S / 2, metadata=call.headers() or None)
            if call.recording:
                call.set(handoff_attrs(response))
    except grpc.aio.AioRpcError as exc:
        await release(pair, dest.reservation_id, writer_stopped=writer_stopped(exc))
        raise HandoffFailed(exc.code(), exc.details() or "", destination_failed(exc)) from exc
    except BaseException:  # cancelled by our caller: P's call was cancelled with us, P may still write
        await release(pair, dest.reservation_id, writer_stopped=False)
        raise
    return Prefilled(dest.reservation_id, response)


async def _reserve(pair: Pair, request: pb.ReserveRequest, timeout_s: float, trace: list[tuple[str, str]]
                   ) -> pb.ReserveResponse:
    """Reserve (carrying the ``trace`` metadata), raising its gRPC error. If our caller is cancelled
    while the call is in flight, the call itself goes on (D may already hold the pages) and what it
    reserves is released: P never saw the destination, so nothing can be writing there."""
    call = in_background(pair.decode.Reserve(request, timeout=timeout_s, metadata=trace or None))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        in_background(_release_reserved(pair, call))
        raise


async def _release_reserved(pair: Pair, call: Awaitable[pb.ReserveResponse]) -> None:
    try:
        reserved = await call
    except Exception:  # no reservation came back (one D makes after our deadline ends with its lease)
        return
    await _release(pair, reserved.destination.reservation_id, writer_stopped=True)


def in_background(work: Awaitable[T]) -> asyncio.Future[T]:
    """Runs ``work`` to its end whatever happens to the caller, which may await the future (in
    ``asyncio.shield`` to leave early without stopping it)."""
    future = asyncio.ensure_future(work)
    _background.add(future)
    future.add_done_callback(_background.discard)
    return future


def handoff_attrs(response: pb.PrefillResponse) -> dict[str, int | float]:
    """A prefill's cache report and handoff figures as span attributes (docs/tracing.md)."""
    cache = response.cache
    return {**at.cached(cache.cached_tokens, {t: getattr(cache, t) for t in TIERS}),
            at.HANDOFF_BYTES: response.transferred_bytes, at.HANDOFF_EXPOSED_S: response.exposed_transfer_seconds}


def writer_stopped(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failed Prefill confirmed that none of its batches can land any more. A P that
    was unreachable, cut off or did not say so may still be writing."""
    return says(exc.trailing_metadata(), WRITER_STOPPED)


def destination_failed(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failed Prefill says its transfer into D failed."""
    return says(exc.trailing_metadata(), DESTINATION_FAILED)


async def generate(pair: Pair, prefilled: Prefilled, sampling: pb.SamplingOptions, resumed: int = 0,
                   span: Span = NO_SPAN, tenant: str = "") -> AsyncIterator[pb.GenerateChunk]:
    """Streams D's chunks; leaving early cancels the stream, which aborts the request on D.
    ``resumed``: the prompt's last tokens were generated (a migration). ``span``: the try's;
    ``tenant``: the reservation's, for D's span."""
    with span.child("tierserve.v1.DecodeService/Generate", SpanKind.CLIENT) as traced:
        call = pair.decode.Generate(pb.GenerateRequest(
            reservation_id=prefilled.reservation_id, first_token=prefilled.response.first_token, sampling=sampling,
            resumed_tokens=resumed, kv_digests=prefilled.response.kv_digests, tenant=tenant),
            metadata=traced.headers() or None)
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()


async def release(pair: Pair, reservation_id: str, writer_stopped: bool) -> None:
    """Ends a reservation, or aborts its running generation. Best effort (a D that is gone
    reclaims the pages itself when the lease runs out), and done even when the caller is
    cancelled meanwhile. Waits for one call at most: a D that does not answer is asked again in
    the background."""
    sent = in_background(_release(pair, reservation_id, writer_stopped))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(sent), RELEASE_TIMEOUT_S)


def release_later(pair: Pair, reservation_id: str, writer_stopped: bool) -> None:
    """``release`` without waiting for it: for a D that may not answer soon (frozen)."""
    in_background(_release(pair, reservation_id, writer_stopped))


async def _release(pair: Pair, reservation_id: str, writer_stopped: bool) -> None:
    """Sends Release until D answers: a frozen D (SIGSTOP, a stalled host) drops calls that time out
    meanwhile, and a reservation nobody releases holds its pages for its whole lease. Stops when D
    answers (a restarted D answers too: it does not know the id) or after ``RELEASE_RETRY_S``;
    a D that is gone for good reclaims the pages when the lease runs out."""
    request = pb.ReleaseRequest(reservation_id=reservation_id, writer_stopped=writer_stopped)
    loop, delay = asyncio.get_running_loop(), 0.25
    give_up = loop.time() + RELEASE_RETRY_S
    while True:
        try:
            await pair.decode.Release(request, timeout=RELEASE_TIMEOUT_S)
            return
        except Exception as exc:  # unreachable, frozen, or its channel closed after a drain
            if loop.time() + delay > give_up:
                log.warning("release of %s never reached its decode node: %s", reservation_id, exc)
                return
            log.debug("release of %s failed (%s); again in %.2f s", reservation_id, exc, delay)
        await asyncio.sleep(delay)
        delay = min(2 * delay, 10.0)
