"""STANDALONE speculation: a draft model proposes tokens in a chain (docs/speculative.md).

The draft's KV is indexed by the target's page ids (``engine/spec/draft_pools.py``: more layers of the
target's pool, or a sidecar pool): a request's page table (``Request.pages``) places its draft KV
too, so there is no second allocator, and whatever frees, keeps, caches or restores a target page
does the same to its draft rows."""

from __future__ import annotations

from pathlib import Path

import torch

from tierserve.engine.cp.runner import CPRunner
from tierserve.engine.procs.token_share import SoleSampler, TokenShare
from tierserve.engine.request import Request
from tierserve.engine.scheduler import Scheduled
from tierserve.engine.spec.draft_pools import DraftKV
from tierserve.engine.spec.drafts import Drafted, SpecCounters, chain
from tierserve.engine.spec.spans import Span, forward
from tierserve.model.attention import LayerHooks
from tierserve.model.loader import load_model
from tierserve.model.parallel import SINGLE, TensorParallel


class ModelDrafter:
    """The draft model's chain (``Drafter``). ``Request.draft_computed`` tokens have KV in the
    draft's rows. Every step the draft computes what the target computes (prefill chunks after the
    target's pass, so a handoff gets the draft's layers after the target's), and a speculating
    request's pending token before its chain; a prefix restored from the cache brings its draft
    rows with it. ``counters``: the decoder's ``SpecCounters`` (prompt catch-up tokens).

    Several tensor ranks (docs/speculative.md, layouts): the draft is split over ``tp`` like the
    target (its heads and MLP rows; its all-reduces ride the same group), its KV holds this rank's
    heads, every rank runs every pass in lock-step, and ``tokens`` (the runner's) makes every rank
    take the sampling rank's draw at each step of the chain.

    Several CP ranks: ``cp`` (the target's ``CPRunner`` over the draft's KV) makes every pass read
    the draft pages other ranks own as a replicated target step reads the target's (the draft's
    page p is on the owner of target page p), every rank running it in lock-step."""

    def __init__(self, draft_dir: Path, draft_kv: DraftKV, device: torch.device, dtype: torch.dtype,
                 counters: SpecCounters, tp: TensorParallel = SINGLE, tokens: TokenShare | None = None,
                 cp: CPRunner | None = None) -> None:
        self.draft, self.draft_kv, self.counters = load_model(draft_dir, device, dtype, tp), draft_kv, counters
        self.tokens, self.cp = tokens or SoleSampler(), cp

    def propose(self, batch: list[Scheduled], hooks: LayerHooks | None) -> dict[str, Drafted]:
        """The draft's chain: per speculating request, its draft tokens and their q rows."""
        spec = [s for s in batch if s.draft_tokens > 0]
        live = [(s, h[-1:]) for s, h in zip(spec, self._forward_sync(spec, hooks), strict=True)]
        return chain(live, lambda spans, _: forward(self.draft, self.draft_kv.kv, spans, cp=self.cp), self.draft.logits,
                     self._chain_span, self._agree)

    def _agree(self, live: list[Scheduled], tokens: list[int]) -> list[int]:
        return self.tokens.share(live, len(tokens), lambda: tokens)

    def target_pass(self, spans: list[Span], hidden: list[torch.Tensor], hooks: LayerHooks | None) -> None:
        """Nothing: the draft reads no target hidden states."""

    def sync(self, batch: list[Scheduled], hooks: LayerHooks | None) -> None:
        """The draft's pass over ``batch``; under CP a long one divides its tokens between the ranks
        (counted in ``SpecCounters.draft_split_steps``), as the target's pass over it did."""
        if batch and not self._forward_sync(batch, hooks, split=True):
            self.counters.draft_split_steps += 1

    def verified(self, request: Request, drafted: Drafted, accepted: int) -> None:
        _chain_verified(request, drafted, accepted)

    def _chain_span(self, request: Request, drafted: list[int]) -> Span:
        return Span([drafted[-1]], request.num_tokens - 1 + len(drafted), request.pages)

    def _forward_sync(self, batch: list[Scheduled], hooks: LayerHooks | None, split: bool = False
                      ) -> list[torch.Tensor]:
        """Feeds the draft each request's tokens of this step and any before them it has no KV for
        (waiting for restored draft layers, telling handoffs of written ones); returns the draft's
        hidden states per request ([] where ``split`` let a long pass divide its tokens between the
        CP ranks: ``spans.forward``). ``draft_computed`` moves only once the pass ran: a step that
        fails (a failed L2 load) leaves it where the KV is, and the step's rerun feeds its tokens again."""
        if not batch:
            return []
        spans = [Span(s.request.tokens(start, s.request.num_computed + s.num_tokens), start, s.request.pages)
                 for s, start in zip(batch, _catch_up(batch, self.counters), strict=True)]
        hidden = forward(self.draft, self.draft_kv.kv, spans, self.draft_kv.hooks(hooks), self.cp, split)
        _synced(batch)
        return hidden


class DraftRelay:
    """STANDALONE or EAGLE on a pipeline stage without the draft (every stage but the last, which
    runs it whole: docs/speculative.md, layouts) (``Drafter``). It computes nothing but keeps the
    books the last stage's ``ModelDrafter`` or ``EagleDrafter`` keeps (``draft_computed``, so every
    stage caches the same pages; the prompt catch-up counter, which rank 0 reports) and takes each
    chain step's draws from the sampling rank, in the same broadcasts, so every stage verifies the
    same drafts. ``keeps_chain``: whether the chain's rows count once verified (a draft model's),
    or are recomputed with the target's features (an EAGLE head's: ``EagleDrafter.verified``)."""

    def __init__(self, counters: SpecCounters, tokens: TokenShare, keeps_chain: bool = True) -> None:
        self.counters, self.tokens, self.keeps_chain = counters, tokens, keeps_chain

    def propose(self, batch: list[Scheduled], hooks: LayerHooks | None) -> dict[str, Drafted]:
        """The sampling rank's drafts, step by step as ``chain`` shares them (this rank never samples)."""
        live = [s for s in batch if s.draft_tokens > 0]
        _catch_up(live, self.counters)
        _synced(live)
        proposals: dict[str, Drafted] = {s.request.request_id: Drafted([], []) for s in live}
        for step in range(max((s.draft_tokens for s in live), default=0)):
            for s, token in zip(live, self.tokens.share(live, len(live), list), strict=True):
                proposals[s.request.request_id].tokens.append(token)
                proposals[s.request.request_id].dists.append(None)  # q is read where the drafts are verified
            live = [s for s in live if s.draft_tokens > step + 1]
        return proposals

    def target_pass(self, spans: list[Span], hidden: list[torch.Tensor], hooks: LayerHooks | None) -> None:
        """Nothing: the draft reads no target hidden states."""

    def sync(self, batch: list[Scheduled], hooks: LayerHooks | None) -> None:
        _catch_up(batch, self.counters)
        _synced(batch)

    def verified(self, request: Request, drafted: Drafted, accepted: int) -> None:
        if self.keeps_chain:
            _chain_verified(request, drafted, accepted)


def _catch_up(batch: list[Scheduled], counters: SpecCounters) -> list[int]:
    """Where the draft's pass over each request of ``batch`` starts (the draft's KV ends there),
    counting the prompt positions it computes after the target had."""
    starts = []
    for s in batch:
        r = s.request
        starts.append(min(r.draft_computed, r.num_computed))
        counters.prompt_catch_up_tokens += max(0, min(r.num_computed, len(r.prompt_ids)) - starts[-1])
    return starts


def _synced(batch: list[Scheduled]) -> None:
    """The draft's KV now covers each request's tokens of this step."""
    for s in batch:
        s.request.draft_computed = s.request.num_computed + s.num_tokens


def _chain_verified(request: Request, drafted: Drafted, accepted: int) -> None:
    """The chain wrote draft KV for the pending token and all drafts but the last."""
    request.draft_computed = request.num_tokens + min(accepted, len(drafted.tokens) - 1)
