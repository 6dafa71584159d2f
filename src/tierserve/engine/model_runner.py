"""Turns a scheduled step into tensors, runs the model once, and samples the next tokens. Under
context parallelism one collaborator, ``CPRunner`` (``engine/cp/runner.py``), sets up how
attention reads the pages other ranks own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from tierserve.cache.device_pool import DeviceKVPool
from tierserve.core.outputs import TokenLogprob
from tierserve.engine.cp.runner import CPRunner, CPStep
from tierserve.engine.logprob_rows import PromptRows, StepLogprobs, prompt_logprobs, prompt_rows, sampled_logprobs
from tierserve.engine.procs.token_share import SoleSampler, TokenShare
from tierserve.engine.request import Request
from tierserve.engine.restores import StepRestores
from tierserve.engine.scheduler import Scheduled, pages_for
from tierserve.model.attention import AttentionBatch, ExtendSpan, LayerHooks
from tierserve.model.llama import CausalLM
from tierserve.model.sampling import SamplingBatch, apply_allowed, sample


@dataclass
class StepResult:
    """The tokens each request that completed its pending tokens gets, in order (one, or with
    speculative decoding the verified drafts and the target's own), and the step's logprobs."""

    tokens: dict[str, list[int]]
    logprobs: StepLogprobs


@dataclass(frozen=True)
class Verify:
    """A speculative step's drafts (docs/speculative.md, layouts): ``drafts`` by request id, the same
    on every rank (made from the request's tokens, which every rank shares); ``judge``, called on the
    sampling rank only, returns the tokens verification keeps for a request from the target's final
    hidden rows [1 + k, hidden] of its pending token and its k drafts (recording their logprobs in
    the ``StepLogprobs`` where asked); ``seen``, called on every rank of the last stage right after
    the target's pass, gets the step's entries (extends then decodes, drafts counted in) and the
    final hidden states of all their rows (an EAGLE head's features)."""

    drafts: Mapping[str, list[int]]
    judge: Callable[[Request, torch.Tensor, StepLogprobs], list[int]]
    seen: Callable[[list[Scheduled], torch.Tensor], None] | None = None


class ModelRunner:
    """Owns the model and the KV pool; ``run`` executes one step of a flat mixed batch.

    Prefill chunks go first in the flat batch (each attends on its own), decode tokens last (all
    attend in one padded batched call). Only requests whose last pending token is in this step
    produce logits and a sampled token. With several ranks, ``tokens`` makes every rank return the
    tokens rank 0 sampled; under context parallelism ``cp`` decides what the model reads its KV from
    and, for a long step, which of the step's rows this rank computes (rank 0 computes every row it
    samples from). A speculative step (``Verify``) runs each drafting request's pending token and
    drafts as one extend span, on every rank like a short prefill chunk, and every rank returns the
    tokens the sampling rank's verification kept.
    """

    def __init__(self, model: CausalLM, pool: DeviceKVPool, device: torch.device,
                 tokens: TokenShare | None = None, cp: CPRunner | None = None) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.page_size = pool.page_size
        self.tokens = tokens or SoleSampler()
        self.cp = cp  # None: this rank holds every page of its KV

    @torch.inference_mode()
    def run(self, batch: list[Scheduled], restores: StepRestores | None = None,
            verify: Verify | None = None) -> StepResult:
        """Samples a token for each request that completed its pending tokens; logprobs are
        computed (on the sampling rank) only for requests that asked. Each layer's attention waits
        for that layer of ``restores`` (default: the batch's, unbounded), whose failures the caller
        judges after the step (``StepRestores.failed``). With ``verify``, a drafting request gets
        the tokens its verification kept instead (the drafts' KV is written past its computed
        tokens, in the pages the scheduler secured for them, which each rank trims alike after)."""
        drafts = verify.drafts if verify is not None else {}
        wide = [replace(s, num_tokens=s.num_tokens + len(drafts.get(s.request.request_id, ()))) for s in batch]
        extends = [s for s in wide if not _is_decode(s)]
        decodes = [s for s in wide if _is_decode(s)]
        ordered = extends + decodes
        ids, positions, slots = self._flat_tokens(ordered, drafts)
        attn = AttentionBatch(page_size=self.page_size, out_slots=slots, hooks=step_hooks(batch, restores))
        attn.extends = self._extend_spans(extends)
        attn.decode_start = len(ids) - len(decodes)
        if decodes:
            attn.decode_pages, attn.decode_mask = self._decode_tables(decodes)
        logprobs, prompt = StepLogprobs(), prompt_rows(ordered)
        # Verification reads every row of a drafting request's span, and a draft head every row's
        # hidden state (``seen``), so such a step stays replicated.
        every_row = bool(prompt) or bool(drafts) or (verify is not None and verify.seen is not None)
        step = self.cp.step(ordered, attn, every_row=every_row) if self.cp is not None else CPStep(self.pool)
        ids_t, positions_t = self._tensor(ids), self._tensor(positions)
        if step.split is not None:  # this rank computes its share of the rows (docs/cp.md)
            ids_t, positions_t = ids_t[step.split.mine], positions_t[step.split.mine]
        hidden = self.model(ids_t, positions_t, attn, step.kv)
        local = step.split.local_rows if step.split is not None else list
        if verify is not None:
            if verify.seen is not None and self.model.pp.last:
                verify.seen(ordered, hidden)
            return self._verified(ordered, hidden, verify, prompt, logprobs, local)
        rows, sampled = _rows_to_sample(ordered)
        tokens = self.tokens.share(ordered, len(rows),
                                   lambda: self._sample(hidden, local(rows), sampled, prompt, logprobs))
        return StepResult({r.request_id: [t] for r, t in zip(sampled, tokens, strict=True)}, logprobs)

    def _verified(self, ordered: list[Scheduled], hidden: torch.Tensor, verify: Verify, prompt: list[PromptRows],
                  logprobs: StepLogprobs, local: Callable[[list[int]], list[int]] = list) -> StepResult:
        """The tokens of a speculative step. Each request that completed gets a slot of 1 + (its
        drafts) tokens in the shared message, led by how many it kept, so every rank knows the
        message's length before it comes. ``local``: this rank's row of each flat row (a step with
        drafts is replicated; one without may be split under CP, docs/cp.md, where the sampling rank
        holds each sequence's last row only)."""
        spans, sampled = _spans_to_sample(ordered, verify.drafts)
        widths = [len(rows) for rows in spans]

        def judge() -> list[int]:
            kept = self._judge(hidden, [local(rows) for rows in spans], sampled, verify, prompt, logprobs)
            return [x for k, w in zip(kept, widths, strict=True) for x in (len(k), *k, *[-1] * (w - len(k)))]

        shared = self.tokens.share(ordered, sum(widths) + len(widths), judge)
        out, at = {}, 0
        for r, w in zip(sampled, widths, strict=True):
            out[r.request_id] = shared[at + 1: at + 1 + shared[at]]
            at += 1 + w
        return StepResult(out, logprobs)

    def _judge(self, hidden: torch.Tensor, spans: list[list[int]], sampled: list[Request], verify: Verify,
               prompt: list[PromptRows], logprobs: StepLogprobs) -> list[list[int]]:
        """On the sampling rank: plain requests' tokens sampled together, drafting ones verified."""
        plain = [i for i, (r, rows) in enumerate(zip(sampled, spans, strict=True)) if len(rows) == 1]
        tokens = self._sample(hidden, [spans[i][0] for i in plain], [sampled[i] for i in plain], prompt, logprobs)
        kept: list[list[int]] = [[t] for t in tokens]
        by_plain = dict(zip(plain, kept, strict=True))
        return [by_plain[i] if i in by_plain else verify.judge(r, hidden[rows[0]: rows[-1] + 1], logprobs)
                for i, (r, rows) in enumerate(zip(sampled, spans, strict=True))]

    def _sample(self, hidden: torch.Tensor, rows: list[int], requests: list[Request], prompt: list[PromptRows],
                logprobs: StepLogprobs) -> list[int]:
        if prompt:
            logprobs.prompt = prompt_logprobs(hidden, prompt, self.model.logits)
        if not rows:
            return []
        tokens, logprobs.sampled = sample_requests(self.model.logits(hidden[self._tensor(rows)]), requests)
        return tokens

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _flat_tokens(self, ordered: list[Scheduled], drafts: Mapping[str, list[int]]
                     ) -> tuple[list[int], list[int], torch.Tensor]:
        ids: list[int] = []
        positions: list[int] = []
        pages: list[int] = []
        for s in ordered:
            r = s.request
            start, end = r.num_computed, r.num_computed + s.num_tokens
            ids += r.tokens(start, min(end, r.num_tokens)) + drafts.get(r.request_id, [])
            positions += range(start, end)
            pages += [r.pages[p // self.page_size] for p in range(start, end)]
        pos = self._tensor(positions)
        slots = self._tensor(pages) * self.page_size + pos % self.page_size
        return ids, positions, slots

    def _extend_spans(self, extends: list[Scheduled]) -> list[ExtendSpan]:
        spans, start = [], 0
        for s in extends:
            r = s.request
            pages = None
            if r.num_computed:
                pages = self._tensor(r.pages[: pages_for(r.num_computed + s.num_tokens, self.page_size)])
            spans.append(ExtendSpan(start, s.num_tokens, r.num_computed, pages))
            start += s.num_tokens
        return spans

    def _decode_tables(self, decodes: list[Scheduled]) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = [s.request.num_computed + 1 for s in decodes]
        width = pages_for(max(lengths), self.page_size)
        table = [s.request.pages[:width] + [0] * (width - len(s.request.pages[:width])) for s in decodes]
        pages = self._tensor(table)
        slots = torch.arange(width * self.page_size, device=self.device)
        mask = slots[None, :] < self._tensor(lengths)[:, None]
        return pages, mask[:, None, None, :]


class _StepHooks:
    """Holds each layer's attention until prefix pages being copied into the pool (from host
    memory: ``restores``) have that layer in place, and tells handoffs when a layer's KV is written."""

    def __init__(self, restores: StepRestores, handoffs: list[Scheduled]) -> None:
        self.restores = restores
        self.handoffs = handoffs

    def before_attention(self, layer_id: int) -> None:
        self.restores.before_attention(layer_id)

    def after_kv_written(self, layer_id: int) -> None:
        for s in self.handoffs:
            s.request.handoff.on_layer(layer_id, s.request.pages, s.request.num_computed + s.num_tokens)


def step_hooks(batch: list[Scheduled], restores: StepRestores | None = None) -> LayerHooks | None:
    """The step's layer hooks (None when no restore or handoff needs them); ``restores``: see ``run``."""
    restores = restores or StepRestores.of(batch)
    handoffs = [s for s in batch if s.request.handoff is not None]
    return _StepHooks(restores, handoffs) if restores.loads or handoffs else None


def _is_decode(s: Scheduled) -> bool:
    return s.num_tokens == 1 and s.request.num_computed > 0


def _rows_to_sample(ordered: list[Scheduled]) -> tuple[list[int], list[Request]]:
    rows, requests, end = [], [], 0
    for s in ordered:
        end += s.num_tokens
        if s.request.num_computed + s.num_tokens == s.request.num_tokens:
            rows.append(end - 1)
            requests.append(s.request)
    return rows, requests


def _spans_to_sample(ordered: list[Scheduled], drafts: Mapping[str, list[int]]
                     ) -> tuple[list[list[int]], list[Request]]:
    """Per request completing its pending tokens, the flat rows verification (or sampling) reads:
    its last row, and with k drafts the k + 1 rows of its pending token and drafts."""
    spans, requests, end = [], [], 0
    for s in ordered:
        end += s.num_tokens
        k = len(drafts.get(s.request.request_id, ()))
        if s.request.num_computed + s.num_tokens - k == s.request.num_tokens:
            spans.append(list(range(end - 1 - k, end)))
            requests.append(s.request)
    return spans, requests


def sample_requests(logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], dict[str, list[TokenLogprob]]]:
    """One token per row of ``logits`` for ``requests``, and the logprobs of those that asked. Both
    read the distribution a structured output's grammar masked (docs/structured.md): a token it
    forbids is never drawn nor listed, and the drawn one's logprob is over the allowed tokens only."""
    batch = sampling_batch(requests)
    logits = apply_allowed(logits, batch.allowed)
    tokens = sample(logits, replace(batch, allowed=None)).tolist()
    return tokens, sampled_logprobs(logits, requests, tokens)


def sampling_batch(requests: list[Request]) -> SamplingBatch:
    """The requests' sampling rows; a structured output's row takes its grammar's allowed tokens."""
    return SamplingBatch(
        temperatures=[0.0 if r.params.greedy else r.params.temperature for r in requests],
        top_ps=[r.params.top_p for r in requests],
        top_ks=[r.params.top_k for r in requests],
        seeds=[r.params.seed for r in requests],
        positions=[r.num_tokens for r in requests],  # the sampled token's index in prompt + output
        banned=[r.banned_now() for r in requests],
        allowed=allowed_tokens(requests),
    )


def allowed_tokens(requests: list[Request]) -> torch.Tensor | None:
    """The bitmask of what each request's grammar allows next (all ones for free rows); None
    when no request has a grammar, the usual case, at no cost."""
    grammars = [r.grammar for r in requests]
    words = next((g.words for g in grammars if g is not None), 0)
    if not words:
        return None
    rows = np.full((len(requests), words), -1, dtype=np.int32)
    for row, grammar in zip(rows, grammars, strict=True):
        if grammar is not None:
            grammar.fill(row)
    return torch.from_numpy(rows)
