"""One forward pass over free-form token spans: what speculative decoding runs, for the draft's chain
and for the target's verification, where the tokens fed are not (yet) a request's own tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tierserve.engine.cp.partial import SeqKeys
from tierserve.engine.cp.runner import CPRunner, CPStep
from tierserve.engine.scheduler import pages_for
from tierserve.model.attention import AttentionBatch, ExtendSpan, KVStore, LayerHooks
from tierserve.model.llama import CausalLM


class PagedKV(KVStore, Protocol):
    """A KV pool's page size and arena (``DeviceKVPool``, or a packed pool's draft layers)."""

    buffer: torch.Tensor

    @property
    def page_size(self) -> int: ...


@dataclass(frozen=True)
class Span:
    """``ids`` at positions ``start, start + 1, ...`` of a sequence whose KV lives in ``pages`` (the
    page table, page ids of ``pool``); positions before ``start`` are read from the pool."""

    ids: list[int]
    start: int
    pages: list[int]

    @property
    def is_decode(self) -> bool:
        return len(self.ids) == 1 and self.start > 0


def forward(model: CausalLM, pool: PagedKV, spans: list[Span], hooks: LayerHooks | None = None,
            cp: CPRunner | None = None, split: bool = False, captured: list[torch.Tensor] | None = None
            ) -> list[torch.Tensor]:
    """Writes every span's KV into ``pool`` and returns each span's final hidden states [len(ids),
    hidden], in the order of ``spans``. Extends attend one by one, single-token decodes in one
    padded batch (as ``ModelRunner.run``). Under context parallelism ``cp`` (over ``pool``) reads
    the pages other ranks own as a replicated target step does (``CPRunner.kv_of``: merged, or
    merged at layer 0 and gathered after): every rank of its group calls this for the same spans.
    ``split``: the caller reads no hidden state, so a long pass divides its extends' tokens between
    the CP ranks as a long target step does (``CPRunner.step_of``) and then returns [] (no rank
    holds every row). ``captured``: filled with each span's rows of ``model.captured`` (the
    target's captures, ``CausalLM.capture_inputs``), in the order of ``spans``."""
    device = pool.buffer.device
    order = [i for i, s in enumerate(spans) if not s.is_decode] + [i for i, s in enumerate(spans) if s.is_decode]
    ordered = [spans[i] for i in order]
    ids = [t for s in ordered for t in s.ids]
    positions = [s.start + j for s in ordered for j in range(len(s.ids))]
    pages = [s.pages[p // pool.page_size] for s in ordered for p in range(s.start, s.start + len(s.ids))]
    pos = _tensor(positions, device)
    slots = _tensor(pages, device) * pool.page_size + pos % pool.page_size
    decodes = [s for s in ordered if s.is_decode]
    attn = AttentionBatch(page_size=pool.page_size, out_slots=slots, hooks=hooks)
    attn.extends = _extends([s for s in ordered if not s.is_decode], pool.page_size, device)
    attn.decode_start = len(ids) - len(decodes)
    if decodes:
        attn.decode_pages, attn.decode_mask = _decode_tables(decodes, pool.page_size, device)
    ids_t = _tensor(ids, device)
    if cp is None:
        step = CPStep(pool)  # type: ignore[arg-type]
    else:
        seqs = _seq_keys(ordered, pool.page_size)
        step = cp.step_of(seqs, attn) if split else CPStep(cp.kv_of(seqs, attn))
    if step.split is not None:
        ids_t, pos = ids_t[step.split.mine], pos[step.split.mine]
    hidden = model(ids_t, pos, attn, step.kv)
    if step.split is not None:
        return []
    starts = [0]
    for s in ordered:
        starts.append(starts[-1] + len(s.ids))
    if captured is not None:
        captured += _per_span(model.captured, order, starts)
    return _per_span(hidden, order, starts)


def _per_span(flat: torch.Tensor, order: list[int], starts: list[int]) -> list[torch.Tensor]:
    """``flat``'s rows per span, in the spans' own order (``order``: the flat batch's)."""
    rows = {i: flat[starts[k]: starts[k + 1]] for k, i in enumerate(order)}
    return [rows[i] for i in range(len(order))]


def _seq_keys(ordered: list[Span], page_size: int) -> list[SeqKeys]:
    """The spans' rows in the flat batch and pages up to their ends, as ``CPRunner.kv_of`` reads them."""
    seqs, row = [], 0
    for s in ordered:
        seqs.append(SeqKeys(row, len(s.ids), s.start, s.pages[: pages_for(s.start + len(s.ids), page_size)]))
        row += len(s.ids)
    return seqs


def _extends(spans: list[Span], page_size: int, device: torch.device) -> list[ExtendSpan]:
    out, start = [], 0
    for s in spans:
        table = _tensor(s.pages[: pages_for(s.start + len(s.ids), page_size)], device) if s.start else None
        out.append(ExtendSpan(start, len(s.ids), s.start, table))
        start += len(s.ids)
    return out


def _decode_tables(decodes: list[Span], page_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [s.start + 1 for s in decodes]
    width = pages_for(max(lengths), page_size)
    table = [s.pages[:width] + [0] * (width - len(s.pages[:width])) for s in decodes]
    slots = torch.arange(width * page_size, device=device)
    mask = slots[None, :] < _tensor(lengths, device)[:, None]
    return _tensor(table, device), mask[:, None, None, :]


def _tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
