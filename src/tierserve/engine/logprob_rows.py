"""Which rows of a step's flat batch give logprobs, and their values (docs/cli.md).

A prompt token's logprob comes from the logits of the position before it, so a chunk computing
positions [start, end) gives the logprobs of prompt tokens start+1 .. min(end, prompt_len - 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierserve.core.outputs import TokenLogprob
from tierserve.engine.request import Request
from tierserve.engine.scheduler import Scheduled
from tierserve.model.logprobs import token_logprobs

Logits = Callable[[torch.Tensor], torch.Tensor]  # final hidden rows -> float32 logits
ROWS_PER_SLICE = 256  # bounds the [rows, vocab] float32 logits a long echoed prompt materializes


@dataclass
class StepLogprobs:
    """The step's logprobs by request id (filled on the sampling rank only): ``sampled`` for the
    tokens each request got (``StepResult.tokens``), ``prompt`` for the prompt tokens its chunk
    completed, in order."""

    sampled: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    prompt: dict[str, list[TokenLogprob]] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptRows:
    """``rows`` of the flat batch whose logits score the prompt tokens ``targets`` of ``request``."""

    request: Request
    rows: list[int]
    targets: list[int]


def prompt_rows(ordered: list[Scheduled]) -> list[PromptRows]:
    """The rows of requests that still need prompt logprobs; empty (and cheap) for the rest."""
    out, base = [], 0
    for s in ordered:
        r = s.request
        end = min(r.num_computed + s.num_tokens, len(r.prompt_ids) - 1)
        targets = range(max(r.prompt_logprobs_next, r.num_computed + 1), end + 1)
        if targets:
            rows = [base + t - 1 - r.num_computed for t in targets]
            out.append(PromptRows(r, rows, [r.prompt_ids[t] for t in targets]))
        base += s.num_tokens
    return out


def prompt_logprobs(hidden: torch.Tensor, wanted: list[PromptRows], logits: Logits) -> dict[str, list[TokenLogprob]]:
    """Every wanted prompt token's logprob and its request's top alternatives, a slice of rows at a time."""
    rows = [row for w in wanted for row in w.rows]
    targets = [t for w in wanted for t in w.targets]
    ks = [w.request.params.prompt_logprobs or 0 for w in wanted for _ in w.rows]
    values: list[TokenLogprob] = []
    for i in range(0, len(rows), ROWS_PER_SLICE):
        index = torch.tensor(rows[i : i + ROWS_PER_SLICE], dtype=torch.int64, device=hidden.device)
        values += token_logprobs(logits(hidden[index]), targets[i : i + ROWS_PER_SLICE], ks[i : i + ROWS_PER_SLICE])
    out, start = {}, 0
    for w in wanted:
        out[w.request.request_id], start = values[start : start + len(w.rows)], start + len(w.rows)
    return out


def sampled_logprobs(logits: torch.Tensor, requests: list[Request], tokens: list[int]
                     ) -> dict[str, list[TokenLogprob]]:
    """The logprob of each sampled token, for the requests that asked (none: no work at all)."""
    asked = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not asked:
        return {}
    index = torch.tensor(asked, dtype=torch.int64, device=logits.device)
    values = token_logprobs(logits[index], [tokens[i] for i in asked], [requests[i].params.logprobs for i in asked])
    return {requests[i].request_id: [v] for i, v in zip(asked, values, strict=True)}
