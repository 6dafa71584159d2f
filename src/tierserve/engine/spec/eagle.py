"""EAGLE speculation: a draft head fed with the target's hidden states (docs/speculative.md, EAGLE).

The head's row for a token pairs it with the target's hidden state at the position before it, and
predicts the token after it. Rows are stored at the token's own position (slot s holds the row of
token s with the feature of position s - 1, rope position s: what the published head computes for
s - 1, as attention only sees relative positions), so a page's draft rows depend on its own tokens
and those before it only, like its target KV: a cached page's rows are right for any request that
matches it. Slot 0 has no feature (zeros) and no published row: attention hides it from every
other row (``AttentionBatch.hide_first_slot``).

The target's hidden state of every position it computes (EAGLE-3: the three residual streams the
head reads, side by side, ``CausalLM.capture_inputs``) is kept beside the head's KV, in the
feature plane: the first layers of the draft's pool (packed or sidecar), one hidden state per slot
in its K and V rows. So it is cached, restored, backed up to L3 and handed over in PD with the
page, as the draft's KV is, and the first decode step on a decode node finds the feature of the
last prompt position in the handed pages."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tierserve.engine.config import CPAttention
from tierserve.engine.cp.merge import own_writes
from tierserve.engine.cp.runner import CPRunner
from tierserve.engine.procs.token_share import SoleSampler, TokenShare
from tierserve.engine.request import Request
from tierserve.engine.scheduler import Scheduled
from tierserve.engine.spec.draft_pools import DraftKV
from tierserve.engine.spec.drafts import Drafted, SpecCounters, chain
from tierserve.engine.spec.spans import Span, forward
from tierserve.model.attention import AttentionBatch, KVStore, LayerHooks
from tierserve.model.eagle import Eagle3Head, EagleHead, EagleSpec, load_eagle
from tierserve.model.llama import CausalLM


class FeaturePlane:
    """The target's feature per slot (``hidden`` wide), in ``layers`` KV layers of ``kv`` (K then V rows of
    layer 0, then layer 1, ...), zero-padded to their width. Reads and writes go through the
    step's hooks as the draft's layers 0..layers-1 (``DraftKV.hooks``: loads and handoffs).

    Under context parallelism (``cp``: the CP ranks of this rank's place) slots are logical and a
    page's rows live on its owner at its local slot, as the head's KV: every rank is handed every
    row and writes those of its own pages; a read takes each rank's own rows and sums them over the
    ranks (one all-reduce: exactly one rank holds each row, the others add zeros)."""

    def __init__(self, kv: KVStore, layers: int, hidden: int, cp: CPRunner | None = None) -> None:
        self.kv, self.layers, self.hidden, self.cp = kv, layers, hidden, cp

    def write(self, slots: torch.Tensor, values: torch.Tensor, hooks: LayerHooks | None) -> None:
        """Stores ``values`` [n, hidden] at ``slots`` [n]."""
        if self.cp is not None:
            rows, slots = own_writes(self.cp.own, slots, self.cp.page_size)
            values = values.index_select(0, rows)
        parts = self._parts(values)
        for layer in range(self.layers):
            if hooks is not None:
                hooks.before_attention(layer)  # a load of these pages lands first
            for pool, part in zip(self.kv.layer(layer), parts[layer], strict=True):
                pool.view(pool.shape[0], -1).index_copy_(0, slots, part)
            if hooks is not None:
                hooks.after_kv_written(layer)

    def read(self, slots: torch.Tensor, hooks: LayerHooks | None) -> torch.Tensor:
        """The hidden states [n, hidden] at ``slots`` [n]."""
        if self.cp is None:
            return self._rows(slots, hooks)
        rows, local = own_writes(self.cp.own, slots, self.cp.page_size)
        own = self._rows(local, hooks)
        # each row is on one rank, zeros elsewhere; summed in float32 (gloo's sums), which holds any pool
        # dtype's values exactly
        summed = torch.zeros(len(slots), self.hidden, dtype=torch.float32, device=own.device)
        summed[rows] = own.float()
        dist.all_reduce(summed, group=self.cp.merge_group)
        return summed.to(own.dtype)

    def _rows(self, slots: torch.Tensor, hooks: LayerHooks | None) -> torch.Tensor:
        """The hidden states [n, hidden] at this rank's pool ``slots`` [n]."""
        rows = []
        for layer in range(self.layers):
            if hooks is not None:
                hooks.before_attention(layer)
            rows += [pool.view(pool.shape[0], -1).index_select(0, slots) for pool in self.kv.layer(layer)]
        return torch.cat(rows, dim=-1)[:, : self.hidden]

    def _parts(self, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        k, _ = self.kv.layer(0)
        width = k[0].numel()
        padded = torch.zeros(values.shape[0], 2 * self.layers * width, dtype=k.dtype, device=k.device)
        padded[:, : self.hidden] = values
        rows = padded.view(values.shape[0], self.layers, 2, width)
        return [(rows[:, i, 0], rows[:, i, 1]) for i in range(self.layers)]


class EagleDrafter:
    """The EAGLE head's chain (``Drafter``). ``Request.draft_computed`` counts the leading slots
    whose head rows are computed (with true features: the chain's rows past the pending token use
    the head's own outputs and are recomputed once their tokens are verified)."""

    def __init__(self, spec: EagleSpec, draft_kv: DraftKV, target: CausalLM, device: torch.device,
                 dtype: torch.dtype, counters: SpecCounters, tokens: TokenShare | None = None,
                 target_dir: Path | None = None, cp: CPRunner | None = None) -> None:
        """``spec``: the head's (``eagle_spec``). Several tensor ranks: every rank runs the whole
        head (replicated: one layer, its KV and the plane whole on each rank, fed the target's final
        hidden states or EAGLE-3's captures, which every tensor rank has), and ``tokens`` (the
        runner's) makes it take the sampling rank's draw at each chain step. Pipeline stages: the
        last runs it (``target`` is that stage's, with the LM head; the head copies the embedding
        from ``target_dir`` if that stage has none), the others relay (``DraftRelay``). Several CP
        ranks: ``cp`` (the target's ``CPRunner``) places the plane's and the head's rows on their
        pages' owners, the plane read across them (``FeaturePlane``), the head's attention gathering
        the prefix pages of its layers from their owners every pass (``CPAttention.GATHER``: the
        merged attention's readers cannot hide slot 0)."""
        plane = spec.plane_layers
        self.head = load_eagle(spec, target, plane, device, dtype, target_dir)
        self.cp = cp.over(draft_kv.kv, CPAttention.GATHER, plane) if cp is not None else None  # type: ignore[arg-type]
        self.plane = FeaturePlane(draft_kv.kv, plane, spec.feature_width, self.cp)
        self.draft_kv, self.counters, self.tokens = draft_kv, counters, tokens or SoleSampler()

    def target_pass(self, spans: list[Span], hidden: list[torch.Tensor], hooks: LayerHooks | None) -> None:
        """Keeps the target's feature of every position of the step's pass in the feature plane:
        ``hidden`` is its final hidden states (EAGLE-1) or its captures (EAGLE-3, ``SpecDecoder``)."""
        ps = self.head_page_size
        slots = [s.pages[p // ps] * ps + p % ps for s in spans for p in range(s.start, s.start + len(s.ids))]
        device = hidden[0].device
        self.plane.write(torch.tensor(slots, dtype=torch.int64, device=device), torch.cat(hidden),
                         self.draft_kv.hooks(hooks))

    @property
    def head_page_size(self) -> int:
        return self.draft_kv.kv.page_size  # type: ignore[attr-defined]

    def propose(self, batch: list[Scheduled], hooks: LayerHooks | None) -> dict[str, Drafted]:
        """Per speculating request: its rows up to the pending token's (true features), whose last
        output drafts the first token, then one row per further draft fed the head's own output."""
        spec = [s for s in batch if s.draft_tokens > 0]
        live = [(s, h[-1:]) for s, h in zip(spec, self._forward_sync(spec, hooks), strict=True)]
        return chain(live, lambda spans, rows: self._forward(spans, rows, None), self.head.logits, self._chain_span,
                     lambda requests, tokens: self.tokens.share(requests, len(tokens), lambda: tokens))

    def sync(self, batch: list[Scheduled], hooks: LayerHooks | None) -> None:
        self._forward_sync(batch, hooks)

    def verified(self, request: Request, drafted: Drafted, accepted: int) -> None:
        """Nothing: rows past the pending token's were fed the head's outputs, not the target's
        features, so ``draft_computed`` stays at the pending token's (the next sync recomputes them)."""

    def _chain_span(self, request: Request, drafted: list[int]) -> Span:
        return Span([drafted[-1]], request.num_tokens - 1 + len(drafted), request.pages)

    def _forward_sync(self, batch: list[Scheduled], hooks: LayerHooks | None) -> list[torch.Tensor]:
        """Computes each request's rows from ``draft_computed`` (or its computed tokens, if fewer)
        through this step's tokens, each with the target's feature of the position before it, read
        from the plane (the target's pass wrote this step's); returns the head's outputs per request."""
        if not batch:
            return []
        spans, slots = [], []
        for s in batch:
            r = s.request
            start = min(r.draft_computed, r.num_computed)
            self.counters.prompt_catch_up_tokens += max(0, min(r.num_computed, len(r.prompt_ids)) - start)
            spans.append(Span(r.tokens(start, r.num_computed + s.num_tokens), start, r.pages))
            slots.append(self._feature_slots(spans[-1]))
        features = self._features(slots, hooks)
        hidden = self._forward(spans, features, self.draft_kv.hooks(hooks))
        for s in batch:
            s.request.draft_computed = s.request.num_computed + s.num_tokens
        return hidden

    def _feature_slots(self, span: Span) -> list[int]:
        """The plane slot of the feature of each row of ``span`` (position - 1); -1 for position 0."""
        ps = self.head_page_size
        return [span.pages[(p - 1) // ps] * ps + (p - 1) % ps if p else -1
                for p in range(span.start, span.start + len(span.ids))]

    def _features(self, slots: list[list[int]], hooks: LayerHooks | None) -> list[torch.Tensor]:
        flat = [max(x, 0) for row in slots for x in row]
        device = self.head.fc.weight.device
        rows = self.plane.read(torch.tensor(flat, dtype=torch.int64, device=device), self.draft_kv.hooks(hooks))
        rows[torch.tensor([x < 0 for row in slots for x in row], device=device)] = 0  # slot 0: no feature
        return list(rows.split([len(row) for row in slots]))

    def _forward(self, spans: list[Span], features: list[torch.Tensor], hooks: LayerHooks | None
                 ) -> list[torch.Tensor]:
        return forward(_Fed(self.head, spans, features), self.draft_kv.kv, spans, hooks,  # type: ignore[arg-type]
                       self.cp)


class _Fed:
    """The head as ``spans.forward`` calls a model: the features follow the tokens in the order
    ``forward`` lays the spans out (extends first, then single-token decodes)."""

    def __init__(self, head: EagleHead | Eagle3Head, spans: list[Span], features: list[torch.Tensor]) -> None:
        order = [i for i, s in enumerate(spans) if not s.is_decode] + [i for i, s in enumerate(spans) if s.is_decode]
        self.head, self.features = head, torch.cat([features[i] for i in order])

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, kv: KVStore
                 ) -> torch.Tensor:
        batch.hide_first_slot = True
        return self.head(ids, self.features, positions, batch, kv)
