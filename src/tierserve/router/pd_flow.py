"""One request through a prefill/decode pair (``docs/architecture.md``, a request's life):
Reserve on D, Prefill on P, Generate on D. Any failure releases the reservation at once; the
caller decides whether to retry on a new pair (only while nothing was streamed). No torch here:
the router imports this."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc


class HandoffFailed(RuntimeError):
    """The prefill leg failed (compute, transfer or deadline); ``code`` is its gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


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
                  cache_salt: str = "", timeout_s: float = 60.0) -> Prefilled:
    """Reserve on D then Prefill on P; releases the reservation on any failure (telling D whether
    P is known to have stopped writing) and raises ``HandoffFailed`` or the gRPC error."""
    reserved = await pair.decode.Reserve(pb.ReserveRequest(
        request_id=request_id, prompt_ids=prompt_ids, max_new_tokens=sampling.max_tokens, cache_salt=cache_salt,
    ), timeout=timeout_s)
    dest = reserved.destination
    try:
        response = await pair.prefill.Prefill(pb.PrefillRequest(
            request_id=request_id, prompt_ids=prompt_ids, sampling=sampling, cache_salt=cache_salt,
            destination=dest, timeout_seconds=timeout_s,
        ), timeout=timeout_s + 5)
    except grpc.aio.AioRpcError as exc:
        # P answered: it stopped writing. Unreachable or cut off: it may still write, so D waits out its grace.
        answered = exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                      grpc.StatusCode.DEADLINE_EXCEEDED)
        await release(pair, dest.reservation_id, writer_stopped=answered)
        raise HandoffFailed(exc.code(), exc.details() or "") from exc
    except BaseException:  # cancelled by our caller: P's call was cancelled with us
        await release(pair, dest.reservation_id, writer_stopped=False)
        raise
    return Prefilled(dest.reservation_id, response)


async def generate(pair: Pair, prefilled: Prefilled, sampling: pb.SamplingOptions) -> AsyncIterator[pb.GenerateChunk]:
    """Streams D's chunks; leaving early cancels the stream, which aborts the request on D."""
    call = pair.decode.Generate(pb.GenerateRequest(
        reservation_id=prefilled.reservation_id, first_token=prefilled.response.first_token, sampling=sampling))
    try:
        async for chunk in call:
            yield chunk
    finally:
        call.cancel()


async def release(pair: Pair, reservation_id: str, writer_stopped: bool) -> None:
    """Best effort: a D that is gone reclaims the pages itself when the lease runs out."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        await pair.decode.Release(pb.ReleaseRequest(reservation_id=reservation_id, writer_stopped=writer_stopped),
                                  timeout=5)
