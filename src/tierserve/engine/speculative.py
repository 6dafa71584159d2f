"""Speculative decoding with a draft model (docs/architecture.md, Speculative decoding).

The draft's KV lives in its own device pool with the target's page count and page size, indexed by
the same page ids: a request's page table (``Request.pages``) places its draft KV too, so there is
no second allocator, and whatever frees or keeps a target page frees or keeps its draft page."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.core.model_config import ModelConfig
from tierserve.core.outputs import TokenLogprob
from tierserve.engine.config import EngineConfig
from tierserve.engine.logprob_rows import StepLogprobs, prompt_logprobs, prompt_rows, sampled_logprobs
from tierserve.engine.model_runner import StepResult, sampling_batch, step_hooks
from tierserve.engine.request import Request
from tierserve.engine.scheduler import Scheduled
from tierserve.engine.spans import Span, forward
from tierserve.model.llama import CausalLM
from tierserve.model.loader import load_model
from tierserve.model.logprobs import token_logprobs
from tierserve.model.sampling import sample
from tierserve.model.spec_sampling import RowSampling, draw, verify


class DraftMismatchError(ValueError):
    """The draft model cannot serve this target (missing folder, other vocabulary, too short)."""


def check_draft(target_dir: Path, draft_dir: Path, max_model_len: int | None = None) -> ModelConfig:
    """The draft's config, or ``DraftMismatchError`` saying why ``draft_dir`` cannot draft for the
    model in ``target_dir``: drafts are verified token id by token id, so vocabularies must match."""
    if not (Path(draft_dir) / "config.json").is_file():
        raise DraftMismatchError(f"--speculative-draft-model-path {draft_dir} is not a model folder (no config.json)")
    target, draft = ModelConfig.from_dir(Path(target_dir)), ModelConfig.from_dir(Path(draft_dir))
    if draft.vocab_size != target.vocab_size:
        raise DraftMismatchError(f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the "
                                 f"target's ({target.vocab_size}): drafts could not be verified")
    needed = max_model_len or target.max_position
    if draft.max_position < needed:
        raise DraftMismatchError(f"the draft model has {draft.max_position} positions, the engine needs {needed}")
    return draft


def draft_geometry(draft: ModelConfig, target: KVGeometry) -> KVGeometry:
    """The draft pool's shape: the draft's layers and heads, the target's page size and dtype."""
    return KVGeometry(draft.num_layers, draft.num_kv_heads, draft.head_dim, target.page_size, target.dtype)


def draft_bytes_per_token(config: EngineConfig, target: KVGeometry, max_model_len: int) -> int:
    """The draft pool's bytes per token beside ``target``'s (0 without a draft), after
    ``check_draft``: the KV pool's size on CUDA counts both pools."""
    if config.speculative_draft_model_path is None:
        return 0
    draft = check_draft(config.model_dir, config.speculative_draft_model_path, max_model_len)
    return draft_geometry(draft, target).bytes_per_token


@dataclass
class SpecCounters:
    """Totals since start: draft tokens proposed and accepted, and verifications that had drafts."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0

    def stats(self) -> dict[str, float]:
        return {"spec_draft_tokens": self.draft_tokens, "spec_accepted_tokens": self.accepted_tokens,
                "spec_verify_steps": self.verify_steps}


class SpecDecoder:
    """Runs a step whose decoding requests speculate: the draft proposes ``Scheduled.draft_tokens``
    tokens in a chain, the target scores them all in one pass with the step's prefill chunks, and
    ``verify`` keeps what the target would have produced. ``run`` returns, per request that got
    tokens, the tokens to append in order (the engine advances ``num_computed`` by one per token
    after the first, the fed drafts whose KV is now part of the sequence).

    Draft KV: ``Request.draft_computed`` tokens have KV in the draft pool. The draft catches up
    lazily from there when a request decodes (its prompt, a cached prefix, a recomputation after
    preemption), at most ``catch_up_tokens`` per step over the batch; a request still behind
    decodes without drafts that step.
    """

    def __init__(self, target: CausalLM, pool: DeviceKVPool, draft_dir: Path, steps: int, catch_up_tokens: int,
                 dtype: torch.dtype) -> None:
        self.target, self.pool, self.steps = target, pool, steps
        self.catch_up_tokens = catch_up_tokens
        self.draft = load_model(draft_dir, pool.buffer.device, dtype)
        geometry = draft_geometry(self.draft.config, pool.geometry)
        self.draft_pool = DeviceKVPool(geometry, pool.num_pages, pool.buffer.device)  # same page ids
        self.counters = SpecCounters()

    @classmethod
    def of(cls, config: EngineConfig, target: CausalLM, pool: DeviceKVPool) -> SpecDecoder | None:
        """The engine's decoder for ``config`` (None without a draft model); the draft catches up at
        most a prefill chunk per step."""
        if config.speculative_draft_model_path is None:
            return None
        return cls(target, pool, config.speculative_draft_model_path, config.spec_steps, config.chunked_prefill_size,
                   pool.geometry.dtype)

    def lookahead(self, request: Request) -> int:
        """Draft tokens worth proposing for ``request`` now: never more than it may still append minus
        one, so verification never writes past its token budget or context length, and none while
        ``min_tokens`` still masks EOS and stop ids."""
        if request.banned_now():  # before min_tokens EOS is masked; verification samples unmasked
            return 0
        left = request.params.max_tokens - len(request.output_ids)
        return max(0, min(self.steps, left - 1))

    @torch.inference_mode()
    def run(self, batch: list[Scheduled]) -> StepResult:
        drafts = self._propose([s for s in batch if s.draft_tokens > 0])
        spans = [self._target_span(s, drafts.get(s.request.request_id)) for s in batch]
        hidden = forward(self.target, self.pool, spans, step_hooks(batch))
        logprobs = StepLogprobs(prompt=self._prompt_logprobs(batch, hidden))
        out = StepResult({}, logprobs)
        plain = [i for i, s in enumerate(batch) if _completes(s) and s.request.request_id not in drafts]
        if plain:
            requests = [batch[i].request for i in plain]
            logits = self.target.logits(torch.cat([hidden[i][-1:] for i in plain]))
            tokens = sample(logits, sampling_batch(requests)).tolist()
            out.tokens |= {r.request_id: [t] for r, t in zip(requests, tokens, strict=True)}
            logprobs.sampled |= sampled_logprobs(logits, requests, tokens)
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
        the target's distribution when asked (the logits row before each kept token)."""
        tokens, dists = drafted
        logits = self.target.logits(hidden)
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

    def _propose(self, spec: list[Scheduled]) -> dict[str, tuple[list[int], list]]:
        """The draft's chain: per request whose draft KV caught up, (draft tokens, their q rows)."""
        ready = self._catch_up(spec)
        proposals: dict[str, tuple[list[int], list]] = {s.request.request_id: ([], []) for s, _ in ready}
        live = ready
        for step in range(max((s.draft_tokens for s, _ in ready), default=0)):
            if step:
                spans = [self._chain_span(s.request, proposals[s.request.request_id][0]) for s, _ in live]
                live = [(s, h[-1:]) for (s, _), h in zip(live, forward(self.draft, self.draft_pool, spans),
                                                         strict=True)]
            tokens, dists = draw(self.draft.logits(torch.cat([h for _, h in live])), [_row(s.request) for s, _ in live])
            for (s, _), token, q in zip(live, tokens, dists, strict=True):
                proposals[s.request.request_id][0].append(token)
                proposals[s.request.request_id][1].append(q)
            live = [(s, h) for s, h in live if s.draft_tokens > step + 1]
        return proposals

    def _chain_span(self, request: Request, drafted: list[int]) -> Span:
        return Span([drafted[-1]], request.num_tokens - 1 + len(drafted), request.pages)

    def _catch_up(self, spec: list[Scheduled]) -> list[tuple[Scheduled, torch.Tensor]]:
        """Feeds the draft each request's tokens it has no KV for yet (within the step's budget);
        returns the requests now level with the target and the draft's hidden state at their
        pending token (what the first draft token is drawn from)."""
        budget, spans, level = self.catch_up_tokens, [], []
        for s in spec:
            r = s.request
            take = min(r.num_tokens - r.draft_computed, max(budget, 1))
            budget -= take
            spans.append(Span(r.tokens(r.draft_computed, r.draft_computed + take), r.draft_computed, r.pages))
            r.draft_computed += take
            level.append(r.draft_computed == r.num_tokens)
        if not spans:
            return []
        hidden = forward(self.draft, self.draft_pool, spans)
        return [(s, h[-1:]) for s, h, ok in zip(spec, hidden, level, strict=True) if ok]


def _completes(s: Scheduled) -> bool:
    return s.request.num_computed + s.num_tokens == s.request.num_tokens


def _row(request: Request) -> RowSampling:
    p = request.params
    return RowSampling(0.0 if p.greedy else p.temperature, p.top_p, p.top_k, request.generator)

