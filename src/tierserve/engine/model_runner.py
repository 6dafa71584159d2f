"""Turns a scheduled step into tensors, runs the model once, and samples the next tokens."""

from __future__ import annotations

import torch

from tierserve.cache.cp_pages import PageOwnership
from tierserve.cache.device_pool import DeviceKVPool
from tierserve.engine.cp_gather import GatherClock, LayerGather, plan_rows, renumber
from tierserve.engine.request import Request
from tierserve.engine.scheduler import Scheduled, pages_for
from tierserve.engine.token_share import SoleSampler, TokenShare
from tierserve.model.attention import AttentionBatch, ExtendSpan, LayerHooks
from tierserve.model.llama import CausalLM
from tierserve.model.sampling import SamplingBatch, sample


class ModelRunner:
    """Owns the model and the KV pool; ``run`` executes one step of a flat mixed batch.

    Prefill chunks go first in the flat batch (each attends on its own), decode tokens last (all
    attend in one padded batched call). Only requests whose last pending token is in this step
    produce logits and a sampled token. With several ranks, ``tokens`` makes every rank return the
    tokens rank 0 sampled.
    """

    def __init__(self, model: CausalLM, pool: DeviceKVPool, device: torch.device,
                 tokens: TokenShare | None = None, cp: PageOwnership | None = None) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.page_size = pool.page_size
        self.tokens = tokens or SoleSampler()
        self.cp = cp or PageOwnership()
        self.gather_clock = GatherClock()  # CP only: the exposed share of the per-layer gathers

    @torch.inference_mode()
    def run(self, batch: list[Scheduled], hooks: LayerHooks | None = None) -> dict[str, int]:
        """Returns the sampled token per request id, for requests that completed their pending tokens."""
        extends = [s for s in batch if not _is_decode(s)]
        decodes = [s for s in batch if _is_decode(s)]
        ordered = extends + decodes
        ids, positions, slots = self._flat_tokens(ordered)
        attn = AttentionBatch(page_size=self.page_size, out_slots=slots, hooks=hooks or step_hooks(batch))
        attn.extends = self._extend_spans(extends)
        attn.decode_start = len(ids) - len(decodes)
        if decodes:
            attn.decode_pages, attn.decode_mask = self._decode_tables(decodes)
        kv = self._sharded(ordered, attn) if self.cp.size > 1 else self.pool
        hidden = self.model(self._tensor(ids), self._tensor(positions), attn, kv)
        rows, sampled = _rows_to_sample(ordered)
        tokens = self.tokens.share(ordered, len(rows), lambda: self._sample(hidden, rows, sampled))
        return {r.request_id: t for r, t in zip(sampled, tokens, strict=True)}

    def _sharded(self, ordered: list[Scheduled], attn: AttentionBatch) -> LayerGather:
        """Context parallelism: renumbers ``attn`` onto a step buffer and starts gathering its prefix
        pages from their owners (``engine/cp_gather.py``)."""
        touched = set((attn.out_slots // self.page_size).tolist())
        plan = plan_rows(self.cp, _prefix_pages(ordered, self.page_size), touched,
                         self.pool.num_pages * self.cp.size, self.device)
        slots = renumber(attn, plan.rows)
        attn.hooks = LayerGather(self.cp, self.pool, plan, slots, attn, attn.hooks, clock=self.gather_clock)
        return attn.hooks

    def _sample(self, hidden: torch.Tensor, rows: list[int], requests: list[Request]) -> list[int]:
        if not rows:
            return []
        logits = self.model.logits(hidden[self._tensor(rows)])
        return sample(logits, sampling_batch(requests)).tolist()

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _flat_tokens(self, ordered: list[Scheduled]) -> tuple[list[int], list[int], torch.Tensor]:
        ids: list[int] = []
        positions: list[int] = []
        pages: list[int] = []
        for s in ordered:
            r = s.request
            start, end = r.num_computed, r.num_computed + s.num_tokens
            ids += r.tokens(start, end)
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
    """Holds each layer's attention until prefix pages being copied into the pool (e.g. from host
    memory) have that layer in place, and tells handoffs when a layer's KV is written."""

    def __init__(self, loads: list, handoffs: list[Scheduled]) -> None:
        self.loads = loads
        self.handoffs = handoffs

    def before_attention(self, layer_id: int) -> None:
        for load in self.loads:
            load.wait(layer_id)

    def after_kv_written(self, layer_id: int) -> None:
        for s in self.handoffs:
            s.request.handoff.on_layer(layer_id, s.request.pages, s.request.num_computed + s.num_tokens)


def step_hooks(batch: list[Scheduled]) -> _StepHooks | None:
    loads = [load for s in batch for load in s.request.hit.loads if not load.done()]
    handoffs = [s for s in batch if s.request.handoff is not None]
    return _StepHooks(loads, handoffs) if loads or handoffs else None


def _prefix_pages(ordered: list[Scheduled], page_size: int) -> set[int]:
    """The pages holding tokens computed before this step: what attention reads from their owners."""
    return {p for s in ordered for p in s.request.pages[: pages_for(s.request.num_computed, page_size)]}


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


def sampling_batch(requests: list[Request]) -> SamplingBatch:
    return SamplingBatch(
        temperatures=[0.0 if r.params.greedy else r.params.temperature for r in requests],
        top_ps=[r.params.top_p for r in requests],
        top_ks=[r.params.top_k for r in requests],
        generators=[r.generator for r in requests],
    )
