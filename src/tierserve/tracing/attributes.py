"""Span and attribute names (``docs/tracing.md`` lists them), and the attributes every role sets."""

from __future__ import annotations

from collections.abc import Mapping

from tierserve.core.tiers import TIERS
from tierserve.tracing.spans import Attrs

REQUEST_ID = "tierserve.request_id"
TENANT = "tierserve.tenant"
PROMPT_TOKENS = "tierserve.prompt_tokens"
COMPLETION_TOKENS = "tierserve.completion_tokens"
FINISH_REASON = "tierserve.finish_reason"
CACHED_TOKENS = "tierserve.cached_tokens"  # + ".device", ".host", ".storage": the tier split
PREDICTED_CACHED = "tierserve.predicted_cached_tokens"  # + ".prefill" or ".decode", then the tier: the router's view
HANDOFF_BYTES = "tierserve.handoff.bytes"
HANDOFF_TRANSFER_S = "tierserve.handoff.transfer_seconds"
HANDOFF_EXPOSED_S = "tierserve.handoff.exposed_seconds"
ATTEMPT = "tierserve.attempt"


def request(request_id: str, tenant: str, prompt_tokens: int | None = None) -> Attrs:
    """The request id and tenant (and the prompt's length) every span of a request carries."""
    attrs: dict[str, str | int] = {REQUEST_ID: request_id, TENANT: tenant}
    if prompt_tokens is not None:
        attrs[PROMPT_TOKENS] = prompt_tokens
    return attrs


def cached(total: int, by_tier: Mapping[str, int], prefix: str = CACHED_TOKENS) -> Attrs:
    """Cached prompt tokens, all tiers and each tier (``prefix.device`` ...)."""
    return {prefix: total} | {f"{prefix}.{tier}": int(by_tier.get(tier, 0)) for tier in TIERS}
