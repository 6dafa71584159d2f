"""Speculative decoding with a draft model (docs/speculative.md).

The draft's KV is indexed by the target's page ids (``engine/spec/draft_pools.py``: more layers of the
target's pool, or a sidecar pool): a request's page table (``Request.pages``) places its draft KV
too, so there is no second allocator, and whatever frees, keeps, caches or restores a target page
does the same to its draft rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tierserve.cache.device_pool import DeviceKVPool
from tierserve.core.outputs import TokenLogprob
from tierserve.engine.config import EngineConfig
from tierserve.engine.logprob_rows import StepLogprobs, prompt_logprobs, prompt_rows
from tierserve.engine.model_runner import StepResult, sample_requests, step_hooks
from tierserve.engine.request import Request
from tierserve.engine.restores import StepRestores
from tierserve.engine.scheduler import Scheduled
from tierserve.engine.spec.draft_pools import DraftKV
from tierserve.engine.spec.sampling import RowSampling, draw, verify
from tierserve.engine.spec.spans import Span, forward
from tierserve.model.attention import LayerHooks
from tierserve.model.llama import CausalLM
from tierserve.model.loader import load_model
from tierserve.model.logprobs import token_logprobs
from tierserve.model.sampling import apply_allowed


@dataclass
class SpecCounters:
    """Totals since start: draft tokens proposed and accepted, verifications that had drafts, and
    prompt catch-up tokens: prompt positions the draft computed after the target had (none while
    every cached, restored or handed-over prefix brings its draft KV; the prefix where it does not)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    prompt_catch_up_tokens: int = 0

    def stats(self) -> dict[str, float]:
        return {"spec_draft_tokens": self.draft_tokens, "spec_accepted_tokens": self.accepted_tokens,
                "spec_verify_steps": self.verify_steps, "spec_prompt_catch_up_tokens": self.prompt_catch_up_tokens}


class SpecDecoder:
    """Runs a step whose decoding requests speculate: the draft proposes ``Scheduled.draft_tokens``
    tokens in a chain, the target scores them all in one pass with the step's prefill chunks, and
    ``verify`` keeps what the target would have produced. ``run`` returns, per request that got
    tokens, the tokens to append in order (the engine advances ``num_computed`` by one per token
    after the first, the fed drafts whose KV is now part of the sequence).

    Draft KV: ``Request.draft_computed`` tokens have KV in the draft's rows. Every step the draft
    computes what the target computes (prefill chunks after the target's pass, so a handoff gets
    the draft's layers after the target's), and a speculating request's pending token before its
    chain; a prefix restored from the cache brings its draft rows with it.
    """

    def __init__(self, target: CausalLM, pool: DeviceKVPool, draft_dir: Path, draft_kv: DraftKV, steps: int,
                 dtype: torch.dtype) -> None:
        self.target, self.pool, self.steps, self.draft_kv = target, pool, steps, draft_kv
        self.draft = load_model(draft_dir, pool.buffer.device, dtype)
        self.counters = SpecCounters()

    @classmethod
    def of(cls, config: EngineConfig, target: CausalLM, pool: DeviceKVPool, draft_kv: DraftKV | None
           ) -> SpecDecoder | None:
        """The engine's decoder for ``config`` (None without a draft model)."""
        if draft_kv is None or config.speculative_draft_model_path is None:
            return None
        return cls(target, pool, config.speculative_draft_model_path, draft_kv, config.spec_steps, pool.geometry.dtype)

    def lookahead(self, request: Request) -> int:
        """Draft tokens worth proposing for ``request`` now: never more than it may still append minus
        one, so verification never writes past its token budget or context length, and none while
        ``min_tokens`` still masks EOS and stop ids."""
        if request.banned_now():  # before min_tokens EOS is masked; verification samples unmasked
            return 0
        left = request.params.max_tokens - len(request.output_ids)
        return max(0, min(self.steps, left - 1))

    @torch.inference_mode()
    def run(self, batch: list[Scheduled], restores: StepRestores | None = None) -> StepResult:
        """One speculative step of ``batch``; ``restores`` as in ``ModelRunner.run``."""
        hooks = step_hooks(batch, restores)
        drafts = self._propose([s for s in batch if s.draft_tokens > 0], hooks)
        spans = [self._target_span(s, drafts.get(s.request.request_id)) for s in batch]
        hidden = forward(self.target, self.pool, spans, hooks)
        self._sync([s for s in batch if s.draft_tokens == 0], hooks)
        logprobs = StepLogprobs(prompt=self._prompt_logprobs(batch, hidden))
        out = StepResult({}, logprobs)
        plain = [i for i, s in enumerate(batch) if _completes(s) and s.request.request_id not in drafts]
        if plain:
            requests = [batch[i].request for i in plain]
            tokens, sampled = sample_requests(self.target.logits(torch.cat([hidden[i][-1:] for i in plain])), requests)
            out.tokens |= {r.request_id: [t] for r, t in zip(requests, tokens, strict=True)}
            logprobs.sampled |= sampled
        for s, h in zip(batch, hidden, strict=True):
            if s.request.request_id in drafts:
                self._verify(s.request, drafts[s.request.request_id], h, out)
        return out

    def _prompt_logprobs(self, batch: list[Scheduled], hidden: list[torch.Tensor]) -> dict[str, list[TokenLogprob]]:
        """Prompt logprobs of the step's prefill chunks, from the rows of their own tokens."""
        wanted = prompt_rows(batch)
        if not wanted:
            return {}
        rows = torch.cat([h[: s.num_tokens] for s, h in zip(batch, hidden, strict=True)])
        return prompt_logprobs(rows, wanted, self.target.logits)

    def _target_span(self, s: Scheduled, drafted: tuple[list[int], list] | None) -> Span:
        r = s.request
        ids = r.tokens(r.num_computed, r.num_computed + s.num_tokens)
        return Span(ids + (drafted[0] if drafted else []), r.num_computed, r.pages)

    def _verify(self, request: Request, drafted: tuple[list[int], list], hidden: torch.Tensor,
                out: StepResult) -> None:
        """Puts the tokens verification keeps for ``request`` in ``out``, with their logprobs under
        the target's distribution when asked (the logits row before each kept token, masked by a
        structured output's grammar as verification read it: docs/structured.md)."""
        tokens, dists = drafted
        logits = apply_allowed(self.target.logits(hidden), draft_masks(request, tokens))
        kept = verify(tokens, dists, logits, _row(request))
        accepted = len(kept) - 1
        # The chain wrote draft KV for the pending token and all drafts but the last.
        request.draft_computed = request.num_tokens + min(accepted, len(tokens) - 1)
        request.spec_draft_tokens += len(tokens)
        request.spec_accepted_tokens += accepted
        self.counters.draft_tokens += len(tokens)
        self.counters.accepted_tokens += accepted
        self.counters.verify_steps += 1
        out.tokens[request.request_id] = kept
        if request.params.logprobs is not None:
            k = request.params.logprobs
            out.logprobs.sampled[request.request_id] = token_logprobs(logits[: len(kept)], kept, [k] * len(kept))

    def _propose(self, spec: list[Scheduled], hooks: LayerHooks | None) -> dict[str, tuple[list[int], list]]:
        """The draft's chain: per speculating request, (draft tokens, their q rows)."""
        live = [(s, h[-1:]) for s, h in zip(spec, self._sync(spec, hooks), strict=True)]
        proposals: dict[str, tuple[list[int], list]] = {s.request.request_id: ([], []) for s in spec}
        for step in range(max((s.draft_tokens for s in spec), default=0)):
            if step:
                spans = [self._chain_span(s.request, proposals[s.request.request_id][0]) for s, _ in live]
                hidden = forward(self.draft, self.draft_kv.kv, spans)
                live = [(s, h[-1:]) for (s, _), h in zip(live, hidden, strict=True)]
            rows = [_row(s.request) for s, _ in live]
            tokens, dists = draw(self.draft.logits(torch.cat([h for _, h in live])), rows, step)
            for (s, _), token, q in zip(live, tokens, dists, strict=True):
                proposals[s.request.request_id][0].append(token)
                proposals[s.request.request_id][1].append(q)
            live = [(s, h) for s, h in live if s.draft_tokens > step + 1]
        return proposals

    def _chain_span(self, request: Request, drafted: list[int]) -> Span:
        return Span([drafted[-1]], request.num_tokens - 1 + len(drafted), request.pages)

    def _sync(self, batch: list[Scheduled], hooks: LayerHooks | None) -> list[torch.Tensor]:
        """Feeds the draft each request's tokens of this step and any before them it has no KV for
        (waiting for restored draft layers, telling handoffs of written ones); returns the draft's
        hidden states per request. ``draft_computed`` moves only once the pass ran: a step that
        fails (a failed L2 load) leaves it where the KV is, and the step's rerun feeds its tokens again."""
        if not batch:
            return []
        spans = []
        for s in batch:
            r = s.request
            start = min(r.draft_computed, r.num_computed)
            self.counters.prompt_catch_up_tokens += max(0, min(r.num_computed, len(r.prompt_ids)) - start)
            spans.append(Span(r.tokens(start, r.num_computed + s.num_tokens), start, r.pages))
        hidden = forward(self.draft, self.draft_kv.kv, spans, self.draft_kv.hooks(hooks))
        for s in batch:
            s.request.draft_computed = s.request.num_computed + s.num_tokens
        return hidden


def draft_masks(request: Request, drafts: list[int]) -> torch.Tensor | None:
    """What a structured output's grammar allows at each of the k + 1 positions a verification
    decides (docs/structured.md): the grammar steps through the drafts and is rolled back after, so
    a draft it forbids has target probability 0 and is rejected. Rows after a draft it forbids, or
    after it completed, allow everything: verification never gets past that draft."""
    grammar = request.grammar
    if grammar is None:
        return None
    rows = np.full((len(drafts) + 1, grammar.words), -1, dtype=np.int32)
    valid = grammar.matcher.validate_tokens(drafts)  # leaves the state as it is
    taken = 0
    for i in range(valid + 1):
        if grammar.done:
            break
        grammar.fill(rows[i])
        if i < valid:
            grammar.consume(drafts[i])
            taken += 1
    grammar.rollback(taken)
    return torch.from_numpy(rows)


def _completes(s: Scheduled) -> bool:
    return s.request.num_computed + s.num_tokens == s.request.num_tokens


def _row(request: Request) -> RowSampling:
    p = request.params
    return RowSampling(0.0 if p.greedy else p.temperature, p.top_p, p.top_k, p.seed, request.num_tokens)

