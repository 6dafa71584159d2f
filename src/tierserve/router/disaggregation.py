"""Which nodes serve a request (``docs/pd.md``). Conditional
disaggregation: the estimate is the prompt tokens the picked decode node would compute after what
it already holds (its KV events, through ``CacheView``); below the threshold it serves the whole
request (``DecodeService.GenerateLocal``): the request is spared the prefill/decode round trips
and handoff, and the decode node's running streams wait for that short prefill no longer than for
about one decode step (how the default was measured). Otherwise a prefill node computes the prompt, and
a one-token request ends there (a ``Prefill`` without destination): nothing is left to decode.
No torch here: the router imports this."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from enum import Enum

from tierserve.core.outputs import FinishReason, RequestOutput, TokenLogprob
from tierserve.core.scope import CacheScope
from tierserve.core.tiers import TIERS
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.proto.sampling import logprob_from_proto
from tierserve.router.policies import CachedPrefix
from tierserve.tracing import NO_SPAN, Span, SpanKind

DEFAULT_THRESHOLD = 24  # tokens; measured: benchmarks/disaggregation.py calibrate, benchmarks/RESULTS.md


class ServedPath(Enum):
    """Which path served a request."""

    PREFILL_DECODE = "prefill_decode"  # a prefill node computed the prompt, the decode node generated
    DECODE_ONLY = "decode_only"  # the decode node computed the prompt itself and generated
    PREFILL_ONLY = "prefill_only"  # a one-token request: the prefill node's first token is the answer


@dataclass(frozen=True)
class Disaggregation:
    """``threshold``: a decode node prefills a prompt itself when fewer than this many of its
    tokens are not in its cache (0: always through a prefill node), times the node's CP size
    (``limit``). ``spill_priority``: requests of this priority or a more important one (lower) may
    also be prefilled there when the prefill nodes are backed up (``TTFTView.spills``); None: never."""

    threshold: int = DEFAULT_THRESHOLD
    spill_priority: int | None = None

    def may_spill(self, priority: int) -> bool:
        return self.spill_priority is not None and priority <= self.spill_priority

    def path(self, prompt_len: int, held: CachedPrefix, page_size: int, max_tokens: int, cp_size: int = 1
             ) -> ServedPath:
        """``held``: what the picked decode node, of ``cp_size`` context-parallel ranks, holds of the prompt."""
        if uncached_tokens(prompt_len, held, page_size) < self.limit(cp_size):
            return ServedPath.DECODE_ONLY
        return ServedPath.PREFILL_ONLY if max_tokens == 1 else ServedPath.PREFILL_DECODE

    def limit(self, cp_size: int) -> int:
        """The threshold of a decode node of ``cp_size`` CP ranks: they divide its prefill's work
        (each attends over the keys of its own pages; a step of 256 tokens or more is split whole,
        ``docs/cp.md``), so its running streams wait as long for ``cp_size`` times the tokens."""
        return self.threshold * max(1, cp_size)


def uncached_tokens(prompt_len: int, held: CachedPrefix, page_size: int) -> int:
    """Prompt tokens a node holding ``held`` leading pages (L1 or L2: an L2 page is copied, not
    computed) computes; at least one, since the last prompt token's logits are always computed."""
    return max(1, prompt_len - page_size * (held.device + held.host))


async def generate_local(channel: object, request_id: str, prompt_ids: list[int], sampling: pb.SamplingOptions,
                         scope: CacheScope, router_id: str = "", span: Span = NO_SPAN
                         ) -> AsyncIterator[pb.GenerateChunk]:
    """Streams the decode node's chunks of a whole request; leaving early cancels the call, which
    aborts the request there and frees its pages (so does the end of ``router_id``'s session).
    ``span``: the try's (the call is a client span)."""
    with span.child("tierserve.v1.DecodeService/GenerateLocal", SpanKind.CLIENT) as traced:
        call = pb_grpc.DecodeServiceStub(channel).GenerateLocal(pb.LocalGenerateRequest(
            request_id=request_id, prompt_ids=prompt_ids, sampling=sampling, cache_salt=scope.cache_salt,
            tenant=scope.tenant, router_id=router_id), metadata=traced.headers() or None)
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()


async def prefill_alone(channel: object, request_id: str, prompt_ids: list[int], sampling: pb.SamplingOptions,
                        scope: CacheScope, timeout_s: float, l3_pending: int = 0, router_id: str = "",
                        span: Span = NO_SPAN) -> pb.PrefillResponse:
    """A one-token request on the prefill node alone; raises the gRPC error. ``span``: the try's."""
    with span.child("tierserve.v1.PrefillService/Prefill", SpanKind.CLIENT) as traced:
        return await pb_grpc.PrefillServiceStub(channel).Prefill(pb.PrefillRequest(
            request_id=request_id, prompt_ids=prompt_ids, sampling=sampling, cache_salt=scope.cache_salt,
            tenant=scope.tenant, timeout_seconds=timeout_s, l3_pending_pages=l3_pending, router_id=router_id),
            timeout=timeout_s + 1.0, metadata=traced.headers() or None)


def alone_output(request_id: str, prompt_len: int, response: pb.PrefillResponse, sampling: pb.SamplingOptions
                 ) -> RequestOutput:
    """The whole answer of a one-token request served by the prefill node alone."""
    cache = response.cache
    prompt_logprobs = _padded(response.prompt_logprobs, prompt_len) if sampling.HasField("prompt_logprobs") else None
    return RequestOutput(
        request_id=request_id, new_token_ids=[response.first_token], new_text=response.text, finished=True,
        finish_reason=FinishReason(response.finish_reason), prompt_tokens=prompt_len, completion_tokens=1,
        cached_tokens=cache.cached_tokens, cached_by_tier={t: getattr(cache, t) for t in TIERS if getattr(cache, t)},
        logprobs=[logprob_from_proto(response.first_logprob)] if sampling.HasField("logprobs") else None,
        prompt_logprobs=prompt_logprobs,
    )


@dataclass
class LocalOutputs:
    """Turns one local generation's chunks into outputs; the first chunk's cache report holds for all."""

    request_id: str
    prompt_len: int
    sampling: pb.SamplingOptions
    cache: pb.CacheReport | None = None

    def output(self, chunk: pb.GenerateChunk, first: bool) -> RequestOutput:
        if first:
            self.cache = chunk.cache
        cache = self.cache or pb.CacheReport()
        asked = first and self.sampling.HasField("prompt_logprobs")
        prompt_logprobs = _padded(chunk.prompt_logprobs, self.prompt_len) if asked else None
        return RequestOutput(
            request_id=self.request_id, new_token_ids=list(chunk.token_ids), new_text=chunk.text,
            finished=chunk.finished, finish_reason=FinishReason(chunk.finish_reason) if chunk.finished else None,
            prompt_tokens=self.prompt_len, completion_tokens=chunk.completion_tokens,
            cached_tokens=cache.cached_tokens, cached_by_tier={t: getattr(cache, t) for t in TIERS
                                                              if getattr(cache, t)},
            logprobs=[logprob_from_proto(lp) for lp in chunk.logprobs] if self.sampling.HasField("logprobs")
            else None,
            prompt_logprobs=prompt_logprobs,
            spec_draft_tokens=chunk.spec_draft_tokens, spec_accepted_tokens=chunk.spec_accepted_tokens,
        )


def _padded(scored: Sequence[pb.TokenLogprob], prompt_len: int) -> list[TokenLogprob | None]:
    """The node scored the prompt's last tokens: those before them have no logprob."""
    return [None] * (prompt_len - len(scored)) + [logprob_from_proto(lp) for lp in scored]
