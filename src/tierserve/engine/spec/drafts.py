"""What a speculative step asks of its draft source (docs/speculative.md): ``Drafter``, with a
draft model (``standalone.py``, STANDALONE) or by prompt lookup (``ngram.py``, NGRAM)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tierserve.engine.request import Request
from tierserve.engine.scheduler import Scheduled
from tierserve.engine.spec.sampling import RowSampling, draw
from tierserve.engine.spec.spans import Span
from tierserve.model.attention import LayerHooks


@dataclass
class SpecCounters:
    """Totals since start: draft tokens proposed and accepted, verifications that had drafts, and
    prompt catch-up tokens: prompt positions the draft computed after the target had (none while
    every cached, restored or handed-over prefix brings its draft KV; the prefix where it does not),
    and a draft model's passes under CP whose tokens the ranks divided (docs/speculative.md, STANDALONE at CP)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    prompt_catch_up_tokens: int = 0
    draft_split_steps: int = 0  # a draft model's passes whose tokens the CP ranks divided

    def stats(self) -> dict[str, float]:
        return {"spec_draft_tokens": self.draft_tokens, "spec_accepted_tokens": self.accepted_tokens,
                "spec_verify_steps": self.verify_steps, "spec_prompt_catch_up_tokens": self.prompt_catch_up_tokens,
                "spec_draft_split_steps": self.draft_split_steps}


@dataclass(frozen=True)
class Drafted:
    """A request's draft tokens (at least one) and, per token, the distribution q it was drawn
    from under the request's sampling (None for greedy rows, which verification reads no q for)."""

    tokens: list[int]
    dists: list[torch.Tensor | None]


class Drafter(Protocol):
    """A draft source of ``SpecDecoder``. Per step: ``propose`` before the target's pass,
    ``target_pass`` with its hidden states, ``sync`` after it, ``verified`` once per request whose
    drafts were verified."""

    def propose(self, batch: list[Scheduled], hooks: LayerHooks | None) -> dict[str, Drafted]:
        """Drafts, by request id, for requests of ``batch`` with ``draft_tokens`` > 0 (at most that
        many each; a request left out decodes plainly this step)."""
        ...

    def target_pass(self, spans: list[Span], hidden: list[torch.Tensor], hooks: LayerHooks | None) -> None:
        """The target's final hidden states [len(ids), hidden] of each span of its pass (an EAGLE
        head's features; the other sources keep nothing)."""
        ...

    def sync(self, batch: list[Scheduled], hooks: LayerHooks | None) -> None:
        """After the target's pass: whatever the draft source keeps per token for ``batch``, the
        requests that did not speculate (their prefill chunks and plain decodes)."""
        ...

    def verified(self, request: Request, drafted: Drafted, accepted: int) -> None:
        """``accepted`` of ``drafted`` were kept for ``request``."""
        ...


def row_sampling(request: Request) -> RowSampling:
    """``request``'s sampling for the tokens this step decides (from its next position on)."""
    p = request.params
    return RowSampling(0.0 if p.greedy else p.temperature, p.top_p, p.top_k, p.seed, request.num_tokens)


NextRows = Callable[[list[Span], list[torch.Tensor]], list[torch.Tensor]]  # (spans, rows before them) -> rows
Agree = Callable[[list[Scheduled], list[int]], list[int]]  # (requests, tokens drawn here) -> the tokens kept


def chain(live: list[tuple[Scheduled, torch.Tensor]], next_rows: NextRows,
          logits: Callable[[torch.Tensor], torch.Tensor], chain_span: Callable[[Request, list[int]], Span],
          agree: Agree | None = None) -> dict[str, Drafted]:
    """A chain of drafts (topk 1) for each speculating request of ``live`` (its scheduled entry and
    the draft's last row after syncing up to its pending token): each step draws one token per
    request from ``logits`` of its last row, then ``next_rows`` (the spans of the tokens just drawn,
    the rows before them) computes the rows the next step draws from, until a request has its
    ``draft_tokens``. ``agree`` (several ranks) replaces each step's tokens with the sampling rank's,
    so every rank feeds and verifies the same drafts (its q rows are the sampling rank's only use).
    Shared by every drafter with a model (STANDALONE, EAGLE)."""
    proposals: dict[str, Drafted] = {s.request.request_id: Drafted([], []) for s, _ in live}
    for step in range(max((s.draft_tokens for s, _ in live), default=0)):
        if step:
            spans = [chain_span(s.request, proposals[s.request.request_id].tokens) for s, _ in live]
            live = [(s, h[-1:]) for (s, _), h in zip(live, next_rows(spans, [h for _, h in live]), strict=True)]
        tokens, dists = draw(logits(torch.cat([h for _, h in live])), [row_sampling(s.request) for s, _ in live], step)
        if agree is not None:
            tokens = agree([s for s, _ in live], tokens)
        for (s, _), token, q in zip(live, tokens, dists, strict=True):
            proposals[s.request.request_id].tokens.append(token)
            proposals[s.request.request_id].dists.append(q)
        live = [(s, h) for s, h in live if s.draft_tokens > step + 1]
    return proposals
