"""Speculative decoding (docs/speculative.md): a draft source proposes tokens (``Drafter``: a draft
model, ``standalone.py``, an EAGLE head, ``eagle.py``, or prompt lookup, ``ngram.py``), the target
verifies them in one pass."""

from __future__ import annotations

import numpy as np
import torch

from tierserve.cache.device_pool import DeviceKVPool
from tierserve.core.outputs import TokenLogprob
from tierserve.engine.config import EngineConfig, SpeculativeAlgorithm
from tierserve.engine.logprob_rows import StepLogprobs, prompt_logprobs, prompt_rows
from tierserve.engine.model_runner import ModelRunner, StepResult, Verify, sample_requests, step_hooks
from tierserve.engine.request import Request
from tierserve.engine.restores import StepRestores
from tierserve.engine.scheduler import Scheduled
from tierserve.engine.spec.draft_pools import DraftKV
from tierserve.engine.spec.drafts import Drafted, Drafter, SpecCounters, row_sampling
from tierserve.engine.spec.eagle import EagleDrafter
from tierserve.engine.spec.ngram import NgramDrafter
from tierserve.engine.spec.sampling import verify
from tierserve.engine.spec.spans import Span, forward
from tierserve.engine.spec.standalone import DraftRelay, ModelDrafter
from tierserve.model.eagle import eagle_spec
from tierserve.model.llama import CausalLM
from tierserve.model.logprobs import token_logprobs
from tierserve.model.parallel import SINGLE, TensorParallel
from tierserve.model.sampling import apply_allowed


class SpecDecoder:
    """Runs a step whose decoding requests speculate: the drafter proposes up to
    ``Scheduled.draft_tokens`` tokens each, the target scores them all in one pass with the step's
    prefill chunks, and ``verify`` keeps what the target would have produced. ``run`` returns, per
    request that got tokens, the tokens to append in order (the engine advances ``num_computed`` by
    one per token after the first, the fed drafts whose KV is now part of the sequence).

    With a ``runner`` (NGRAM, whose drafts need no model: the same on every rank; STANDALONE at
    several tensor ranks, whose chain every rank runs, taking the sampling rank's draws), the
    target's pass is ``ModelRunner``'s, so it runs at TP, CP and PP layouts: the sampling rank
    verifies and every rank appends its kept tokens and counts them alike (docs/speculative.md,
    layouts)."""

    def __init__(self, target: CausalLM, pool: DeviceKVPool, drafter: Drafter, steps: int,
                 counters: SpecCounters, runner: ModelRunner | None = None, feeds_hidden: bool = False) -> None:
        """``feeds_hidden``: the drafter reads the target's hidden states (EAGLE; on every stage alike)."""
        self.target, self.pool, self.drafter, self.steps, self.counters = target, pool, drafter, steps, counters
        self.runner, self.feeds_hidden = runner, feeds_hidden

    @classmethod
    def of(cls, config: EngineConfig, target: CausalLM, pool: DeviceKVPool, draft_kv: DraftKV | None,
           runner: ModelRunner, tp: TensorParallel = SINGLE) -> SpecDecoder | None:
        """The engine's decoder for ``config`` (None without speculation; ``draft_kv``: the draft's
        or EAGLE head's, None on a pipeline stage without it; ``runner``: the engine's, which the
        target's pass runs on at several ranks; ``tp``: the rank's tensor shard, the draft model's too)."""
        algorithm, counters, device = config.spec_algorithm, SpecCounters(), pool.buffer.device
        if algorithm is SpeculativeAlgorithm.EAGLE:  # every stage: each sends on what it took (EAGLE-3)
            head = eagle_spec(config.speculative_draft_model_path, target.config.num_layers)
            target.capture_inputs(head.capture)
        if algorithm is SpeculativeAlgorithm.NGRAM:
            drafter: Drafter = NgramDrafter(config.ngram_sizes, target.config.vocab_size, device)
        elif algorithm is None:
            return None
        elif draft_kv is None:  # a pipeline stage without the draft
            drafter = DraftRelay(counters, runner.tokens, keeps_chain=algorithm is SpeculativeAlgorithm.STANDALONE)
        elif algorithm is SpeculativeAlgorithm.STANDALONE:
            path = config.speculative_draft_model_path
            cp = runner.cp.over(draft_kv.kv) if runner.cp is not None else None  # type: ignore[arg-type]
            drafter = ModelDrafter(path, draft_kv, device, pool.geometry.dtype, counters, tp, runner.tokens, cp)
        else:
            drafter = EagleDrafter(head, draft_kv, target, device, pool.geometry.dtype, counters, runner.tokens,
                                   config.model_dir, runner.cp)
        on_ranks = runner if algorithm is SpeculativeAlgorithm.NGRAM or config.num_ranks > 1 else None
        return cls(target, pool, drafter, config.spec_steps, counters, on_ranks,
                   algorithm is SpeculativeAlgorithm.EAGLE)

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
        if self.runner is not None:
            return self._run_ranks(batch, restores)
        hooks = step_hooks(batch, restores)
        drafts = self.drafter.propose(batch, hooks)
        spans = [self._target_span(s, drafts.get(s.request.request_id)) for s in batch]
        captured = [] if self.target.capture else None
        hidden = forward(self.target, self.pool, spans, hooks, captured=captured)
        self.drafter.target_pass(spans, hidden if captured is None else captured, hooks)
        self.drafter.sync([s for s in batch if s.draft_tokens == 0], hooks)
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

    def _run_ranks(self, batch: list[Scheduled], restores: StepRestores | None) -> StepResult:
        """The step on ``runner`` (every rank): drafts, the target's pass with them, the sampling
        rank's verification, the draft's pass over the step's other tokens (after the target's, so
        a handoff gets the draft's layers after the target's), and on every rank the count of what
        was kept."""
        hooks = step_hooks(batch, restores)
        drafts = self.drafter.propose(batch, hooks)

        def judge(request: Request, hidden: torch.Tensor, logprobs: StepLogprobs) -> list[int]:
            return self._judge(request, drafts[request.request_id], hidden, logprobs)

        def seen(ordered: list[Scheduled], hidden: torch.Tensor) -> None:
            spans = [_wide_span(s, drafts.get(s.request.request_id)) for s in ordered]
            features = self.target.captured if self.target.capture else hidden  # EAGLE-3: its captures
            self.drafter.target_pass(spans, list(features.split([len(x.ids) for x in spans])), hooks)

        # only a head fed the target's hidden states needs them (so its steps are never split, on every stage)
        verify = Verify({rid: d.tokens for rid, d in drafts.items()}, judge, seen if self.feeds_hidden else None)
        out = self.runner.run(batch, restores, verify)
        self.drafter.sync([s for s in batch if s.draft_tokens == 0], hooks)
        for s in batch:
            rid = s.request.request_id
            if rid in drafts:
                self._count(s.request, drafts[rid], out.tokens[rid])
        return out

    def _prompt_logprobs(self, batch: list[Scheduled], hidden: list[torch.Tensor]) -> dict[str, list[TokenLogprob]]:
        """Prompt logprobs of the step's prefill chunks, from the rows of their own tokens."""
        wanted = prompt_rows(batch)
        if not wanted:
            return {}
        rows = torch.cat([h[: s.num_tokens] for s, h in zip(batch, hidden, strict=True)])
        return prompt_logprobs(rows, wanted, self.target.logits)

    def _target_span(self, s: Scheduled, drafted: Drafted | None) -> Span:
        r = s.request
        ids = r.tokens(r.num_computed, r.num_computed + s.num_tokens)
        return Span(ids + (drafted.tokens if drafted else []), r.num_computed, r.pages)

    def _verify(self, request: Request, drafted: Drafted, hidden: torch.Tensor,
                out: StepResult) -> None:
        """Puts the tokens verification keeps for ``request`` in ``out`` and counts them."""
        kept = out.tokens[request.request_id] = self._judge(request, drafted, hidden, out.logprobs)
        self._count(request, drafted, kept)

    def _judge(self, request: Request, drafted: Drafted, hidden: torch.Tensor, logprobs: StepLogprobs) -> list[int]:
        """The tokens verification keeps for ``request`` (``hidden``: the target's rows of its
        pending token and drafts), with their logprobs under the target's distribution when asked
        (the logits row before each kept token, masked by a structured output's grammar as
        verification read it: docs/structured.md)."""
        logits = apply_allowed(self.target.logits(hidden), draft_masks(request, drafted.tokens))
        kept = verify(drafted.tokens, drafted.dists, logits, row_sampling(request))
        if request.params.logprobs is not None:
            k = request.params.logprobs
            logprobs.sampled[request.request_id] = token_logprobs(logits[: len(kept)], kept, [k] * len(kept))
        return kept

    def _count(self, request: Request, drafted: Drafted, kept: list[int]) -> None:
        """Counts ``kept`` (the accepted drafts and the target's token) on every rank alike."""
        accepted = len(kept) - 1
        self.drafter.verified(request, drafted, accepted)
        request.spec_draft_tokens += len(drafted.tokens)
        request.spec_accepted_tokens += accepted
        self.counters.draft_tokens += len(drafted.tokens)
        self.counters.accepted_tokens += accepted
        self.counters.verify_steps += 1


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


def _wide_span(s: Scheduled, drafted: Drafted | None) -> Span:
    """The span of ``ModelRunner.run``'s entry ``s`` (its tokens widened by its drafts, if any)."""
    r, k = s.request, len(drafted.tokens) if drafted else 0
    ids = r.tokens(r.num_computed, r.num_computed + s.num_tokens - k)
    return Span(ids + (drafted.tokens if drafted else []), r.num_computed, r.pages)


def _completes(s: Scheduled) -> bool:
    return s.request.num_computed + s.num_tokens == s.request.num_tokens

