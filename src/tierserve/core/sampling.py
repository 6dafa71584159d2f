"""Per-request generation settings, validated once when the request enters the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tierserve.core.constraint import MAX_SPEC_BYTES, Constraint

# What the control plane can carry (its fields are uint32, int32, uint64 and float32).
MAX_UINT32, MAX_INT32, MAX_UINT64 = 2**32 - 1, 2**31 - 1, 2**64 - 1
MAX_FLOAT32 = 3.4028234663852886e38
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (bad value, too long for the context or the pool)."""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` (or ``top_k == 1``) is greedy. ``top_k <= 0`` and ``top_p == 1`` disable
    those filters. ``seed`` makes a request's samples reproducible whatever else is batched with it.
    Stop strings end generation and are not part of the returned text; stop token ids end it too,
    and so do the model's EOS ids unless ``ignore_eos``. Until ``min_tokens`` tokens are out, EOS and
    stop token ids are never sampled and stop strings do not stop (vLLM's ``min_tokens``).

    ``logprobs``: each generated token's log-probability plus that many top alternatives (None: no
    logprobs); ``prompt_logprobs`` the same for the prompt tokens from ``prompt_logprobs_start`` (at
    least 1: the first token has none) on, which the engine must compute, not take from the cache
    (docs/cli.md).

    ``constraint``: the grammar every output token must keep (docs/structured.md); None: free text.

    Scheduling hints travel with the settings to every node: ``priority`` (vLLM's convention: lower
    is more important, default 0; ``--schedule-policy priority`` admits waiting work in that order and
    preempts less important work for it) and ``deadline_ms``, the milliseconds the client gave the
    first token from when the request arrived where it is now (None: no deadline; docs/router.md).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 1
    constraint: Constraint | None = None
    priority: int = 0
    deadline_ms: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def validate(self) -> None:
        checks = [
            (1 <= self.max_tokens <= MAX_UINT32, f"max_tokens must be in [1, {MAX_UINT32}], got {self.max_tokens}"),
            (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_FLOAT32,
             f"temperature must be a finite number >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (-1 <= self.top_k <= MAX_INT32, f"top_k must be -1, 0 (off) or positive (< 2^31), got {self.top_k}"),
            (self.seed is None or 0 <= self.seed <= MAX_UINT64, f"seed must be in [0, 2^64), got {self.seed}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (all(0 <= t <= MAX_UINT32 for t in self.stop_token_ids), "stop_token_ids must be in [0, 2^32)"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
            (_count_ok(self.logprobs), f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (_count_ok(self.prompt_logprobs),
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (0 <= self.prompt_logprobs_start <= MAX_UINT32,
             f"the prompt logprobs' start must be in [0, 2^32), got {self.prompt_logprobs_start}"),
            (self.constraint is None or 0 < len(self.constraint.spec.encode()) <= MAX_SPEC_BYTES,
             f"a structured-output spec must be 1 to {MAX_SPEC_BYTES} bytes"),
            (-MAX_INT32 - 1 <= self.priority <= MAX_INT32, f"priority must be in [-2^31, 2^31), got {self.priority}"),
            (self.deadline_ms is None or 0 < self.deadline_ms <= MAX_UINT32,
             f"a deadline must be in [1, 2^32) milliseconds, got {self.deadline_ms}"),
            (self.constraint is None or not self.min_tokens,
             "min_tokens cannot be combined with structured outputs (the grammar decides where the output ends)"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)


def _count_ok(k: int | None) -> bool:
    return k is None or 0 <= k <= MAX_LOGPROBS
