"""The router's ``Backend``: each request through a prefill/decode pair (``docs/architecture.md``,
a request's life), with admission control, deadlines, retries on a new pair while nothing was
streamed, and load counted until the stream ends."""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from tierserve.api import openai as oa
from tierserve.core.outputs import FinishReason, RequestOutput
from tierserve.core.sampling import InvalidRequestError, SamplingParams
from tierserve.core.tiers import TIERS
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto.sampling import to_proto
from tierserve.router import pd_flow
from tierserve.router.policies import CachedPrefix, Policy
from tierserve.router.registry import Registry, Worker
from tierserve.router.roles import Role

log = logging.getLogger(__name__)
PrefixLookupFactory = Callable[[list[int], str], Callable[[Worker], CachedPrefix]]


@dataclass(frozen=True)
class RouterOptions:
    max_running: int = 256  # requests in flight through the router
    max_queued: int = 1024  # waiting for a slot; beyond that: 429
    timeout_s: float = 600.0  # a prefill leg's deadline (compute plus KV handoff)
    max_retries: int = 2  # new pairs tried while nothing was streamed
    backoff_s: float = 0.05  # first retry's base delay, doubled each time, with jitter


class PDBackend:
    """Requests through prefill/decode pairs. Errors: 400 for what a node says is invalid, 429
    when the admission queue is full, 503 when no healthy pair exists or every try failed."""

    def __init__(self, registry: Registry, prefill: Policy, decode: Policy, options: RouterOptions,
                 max_model_len: int, lookup: PrefixLookupFactory | None = None) -> None:
        self.registry, self.prefill_policy, self.decode_policy = registry, prefill, decode
        self.options, self.max_model_len = options, max_model_len
        self.lookup = lookup or (lambda tokens, salt: lambda worker: CachedPrefix())
        self._slots = asyncio.Semaphore(options.max_running)
        self._queued = 0
        self.retries = 0
        self.routes: deque[dict[str, object]] = deque(maxlen=256)  # recent decisions, for operators and tests

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return self._queued

    def healthy(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.registry.ready()

    async def debug_state(self) -> dict[str, Any]:
        return {"workers": [w.describe() for w in self.registry.workers.values()], "queued": self._queued,
                "retries": self.retries, "routes": list(self.routes)}

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str
                       ) -> AsyncIterator[RequestOutput]:
        await self._admit()
        try:
            async for out in self._attempts(request_id, prompt_ids, params, cache_salt):
                yield out
        finally:
            self._slots.release()

    async def _admit(self) -> None:
        if self._slots.locked() and self._queued >= self.options.max_queued:
            raise oa.APIError(429, "the server is overloaded: too many requests waiting; retry later",
                              code="overloaded")
        self._queued += 1
        try:
            await self._slots.acquire()
        finally:
            self._queued -= 1

    async def _attempts(self, request_id: str, prompt: list[int], params: SamplingParams, salt: str
                        ) -> AsyncIterator[RequestOutput]:
        """Tries pairs until one streams. A failed pair uses up a retry; a decode node with no room
        (a burst) does not: the request waits with backoff, up to its deadline, as in a queue."""
        sampling, last_error, failures, attempt = to_proto(params), "no attempt", 0, 0
        deadline = asyncio.get_running_loop().time() + self.options.timeout_s
        while failures <= self.options.max_retries:
            if attempt:
                self.retries += 1
                await asyncio.sleep(self._backoff(attempt, deadline))
            attempt += 1
            pair = self._pick(prompt, salt)
            prefill, decode = pair
            prefill.load, decode.load = prefill.load + 1, decode.load + 1
            try:
                stubs, done = await self._prefill(pair, f"{request_id}-{attempt}", prompt, sampling, salt)
                async for out in self._stream(decode, stubs, done, len(prompt), sampling):
                    yield out
                return
            except _Retry as exc:
                last_error = str(exc)
                failures += 0 if exc.busy and asyncio.get_running_loop().time() < deadline else 1
            finally:
                prefill.load, decode.load = prefill.load - 1, decode.load - 1
        raise oa.APIError(503, f"no prefill/decode pair could serve the request: {last_error}", code="unavailable")

    def _backoff(self, attempt: int, deadline: float) -> float:
        """Jittered exponential delay, at most 1 s and never past the deadline."""
        delay = min(1.0, self.options.backoff_s * 2 ** min(attempt - 1, 10)) * (0.5 + random.random())
        return max(0.0, min(delay, deadline - asyncio.get_running_loop().time()))

    def _pick(self, prompt: list[int], salt: str) -> tuple[Worker, Worker]:
        prefills, decodes = self.registry.available(Role.PREFILL), self.registry.available(Role.DECODE)
        if not prefills or not decodes:
            missing = "prefill" if not prefills else "decode"
            raise oa.APIError(503, f"no healthy {missing} worker", code="unavailable")
        lookup = self.lookup(prompt, salt)
        prefill, decode = self.prefill_policy.pick(prefills, lookup), self.decode_policy.pick(decodes, lookup)
        cached = lookup(prefill)
        self.routes.append({"prefill": prefill.address, "decode": decode.address, "prompt_tokens": len(prompt),
                            "prefill_cached_pages": [cached.device, cached.host]})
        log.debug("route: prefill %s (cached pages %s), decode %s", prefill.address, cached, decode.address)
        return prefill, decode

    async def _prefill(self, pair: tuple[Worker, Worker], rid: str, prompt: list[int], sampling: pb.SamplingOptions,
                       salt: str) -> tuple[pd_flow.Pair, pd_flow.Prefilled]:
        prefill, decode = pair
        stubs = pd_flow.Pair.connect(prefill.channel, decode.channel)
        try:
            done = await pd_flow.prefill(stubs, rid, prompt, sampling, salt, self.options.timeout_s)
        except pd_flow.HandoffFailed as exc:
            self._blame(prefill, exc.code, str(exc))
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

    async def _stream(self, decode: Worker, stubs: pd_flow.Pair, done: pd_flow.Prefilled, prompt_len: int,
                      sampling: pb.SamplingOptions) -> AsyncIterator[RequestOutput]:
        cache = done.response.cache
        tiers = {t: getattr(cache, t) for t in TIERS if getattr(cache, t)}
        streamed = False
        try:
            async for chunk in pd_flow.generate(stubs, done, sampling):
                streamed = True
                reason = FinishReason(chunk.finish_reason) if chunk.finished else None
                yield RequestOutput(
                    request_id=done.reservation_id, new_token_ids=list(chunk.token_ids), new_text=chunk.text,
                    finished=chunk.finished, finish_reason=reason,
                    prompt_tokens=prompt_len, completion_tokens=chunk.completion_tokens,
                    cached_tokens=cache.cached_tokens, cached_by_tier=tiers,
                )
        except grpc.aio.AioRpcError as exc:
            self.registry.failed(decode, exc.code().name, unreachable=exc.code() is grpc.StatusCode.UNAVAILABLE)
            if not streamed:  # e.g. the lease ran out or the node died: the client saw nothing yet
                await pd_flow.release(stubs, done.reservation_id, writer_stopped=True)
                raise _Retry(f"generate on {decode.address}: {exc.code().name} {exc.details()}") from exc
            raise oa.APIError(502, f"decode worker {decode.address} failed mid-stream: {exc.details()}") from exc
        self.registry.succeeded(decode)


class _Retry(Exception):
    """This pair failed before anything was streamed: try another. ``busy``: the worker was only
    full, not broken."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy
