"""Conditional disaggregation (``docs/architecture.md``, the PD path): per request, whether the
decode node computes the prompt itself or a prefill node does. The estimate is the prompt tokens
the picked decode node would compute after what it already holds (its KV events, through
``CacheView``); below the threshold it serves the whole request (``DecodeService.GenerateLocal``),
since a short prefill costs it less than the prefill/decode round trip costs the request. No
torch here: the router imports this."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import Enum

from tierserve.core.outputs import FinishReason, RequestOutput
from tierserve.core.tiers import TIERS
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.proto.sampling import logprob_from_proto
from tierserve.router.policies import CachedPrefix

DEFAULT_THRESHOLD = 256  # tokens; measured in benchmarks/RESULTS.md (conditional disaggregation)


class ServedPath(Enum):
    """Which path served a request."""

    PREFILL_DECODE = "prefill_decode"  # a prefill node computed the prompt, the decode node generated
    DECODE_ONLY = "decode_only"  # the decode node computed the prompt itself and generated


@dataclass(frozen=True)
class Disaggregation:
    """``threshold``: a decode node prefills a prompt itself when fewer than this many of its
    tokens are not in its cache (0: always through a prefill node)."""

    threshold: int = DEFAULT_THRESHOLD

    def path(self, prompt_len: int, held: CachedPrefix, page_size: int) -> ServedPath:
        if uncached_tokens(prompt_len, held, page_size) < self.threshold:
            return ServedPath.DECODE_ONLY
        return ServedPath.PREFILL_DECODE


def uncached_tokens(prompt_len: int, held: CachedPrefix, page_size: int) -> int:
    """Prompt tokens a node holding ``held`` leading pages (L1 or L2: an L2 page is copied, not
    computed) computes; at least one, since the last prompt token's logits are always computed."""
    return max(1, prompt_len - page_size * (held.device + held.host))


async def generate_local(channel: object, request_id: str, prompt_ids: list[int], sampling: pb.SamplingOptions,
                         cache_salt: str) -> AsyncIterator[pb.GenerateChunk]:
    """Streams the decode node's chunks of a whole request; leaving early cancels the call, which
    aborts the request there and frees its pages."""
    call = pb_grpc.DecodeServiceStub(channel).GenerateLocal(pb.LocalGenerateRequest(
        request_id=request_id, prompt_ids=prompt_ids, sampling=sampling, cache_salt=cache_salt))
    try:
        async for chunk in call:
            yield chunk
    finally:
        call.cancel()


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
        prompt_logprobs = None
        if first and self.sampling.HasField("prompt_logprobs"):
            scored = [logprob_from_proto(lp) for lp in chunk.prompt_logprobs]
            prompt_logprobs = [None] * (self.prompt_len - len(scored)) + scored
        return RequestOutput(
            request_id=self.request_id, new_token_ids=list(chunk.token_ids), new_text=chunk.text,
            finished=chunk.finished, finish_reason=FinishReason(chunk.finish_reason) if chunk.finished else None,
            prompt_tokens=self.prompt_len, completion_tokens=chunk.completion_tokens,
            cached_tokens=cache.cached_tokens, cached_by_tier={t: getattr(cache, t) for t in TIERS
                                                              if getattr(cache, t)},
            logprobs=[logprob_from_proto(lp) for lp in chunk.logprobs] if self.sampling.HasField("logprobs")
            else None,
            prompt_logprobs=prompt_logprobs,
        )
