"""Context parallelism without moving pages: every rank attends over the pages it owns and the ranks
merge their partial results (``docs/cp.md``, "Merged attention").

Used where a gather of the prefix could not be hidden behind compute: every layer of a *short* step
(each sequence brings at most one page of new tokens: decodes, the last page after a prefix hit),
and layer 0 of a longer step, which has no earlier layer to overlap its gather with (the gathers of
layers 1.. then each overlap the layer before, ``engine/cp/gather.py``). Each rank computes, for every
query, attention over the keys of its own pages (``engine/cp/partial.py``: normalised output and
log-sum-exp); one all-gather of those partials per layer lets every rank merge them exactly:
``out = sum_r exp(lse_r - lse) * out_r`` with ``lse = logsumexp_r lse_r``. A token's key is read by its
page's owner only, so each key counts once. The owner writes the step's new K/V into its pool before
attending, as under the gather.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from tierserve.cache.device_pool import DeviceKVPool
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.model.attention import LayerHooks
from tierserve.model.partial_attention import combine


@dataclass
class MergeClock:
    """Steps that merged (every layer, or layer 0 only), and the seconds spent in merge all-gathers."""

    short_steps: int = 0
    first_layer_steps: int = 0
    seconds: float = 0.0

    def stats(self) -> dict[str, float]:
        return {"cp_merge_short_steps_total": float(self.short_steps),
                "cp_merge_first_layer_steps_total": float(self.first_layer_steps),
                "cp_merge_seconds_total": self.seconds}


class KeyReader(Protocol):
    """This rank's attention over the keys it owns: q [T, heads, dim] -> out [T, heads, dim] float32
    (0 where a query sees no key here) and lse [T, heads] (-inf there)."""

    def attend(self, q: torch.Tensor, pool: tuple[torch.Tensor, torch.Tensor], scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]: ...


def short_step(new_tokens: list[int], page_size: int) -> bool:
    """Whether every layer of a step merges: every sequence brings at most a page of tokens."""
    return all(n <= page_size for n in new_tokens)


def own_writes(own: PageOwnership, slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat rows of the step's new tokens whose pages this rank owns (``slots``: their logical
    pool slots), and their slots in this rank's pool."""
    pages = slots // page_size
    rows = torch.nonzero(pages % own.size == own.rank).flatten()
    return rows, (pages[rows] // own.size) * page_size + slots[rows] % page_size


class MergedAttention:
    """``PartialAttention`` (``model/attention.py``) for the layers below ``layers_end``.

    Contract: every rank of ``group`` builds it for the same batch and the forward calls ``attend``
    for those layers in order; each call runs one all-gather of a shape every rank agrees on."""

    def __init__(self, own: PageOwnership, pool: DeviceKVPool, reader: KeyReader, writes: tuple[torch.Tensor,
                 torch.Tensor], inner: LayerHooks | None, layers_end: int, group: dist.ProcessGroup | None = None,
                 clock: MergeClock | None = None) -> None:
        self.own, self.pool, self.reader, self.inner, self.group = own, pool, reader, inner, group
        self.write_rows, self.write_slots = writes
        self.layers_end, self.clock = layers_end, clock

    def covers(self, layer_id: int) -> bool:
        return layer_id < self.layers_end

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [T, heads, dim], k/v [T, kv_heads, dim] -> [T, heads * dim], merged over the ranks."""
        pool = self.pool.layer(layer_id)
        for store, new in zip(pool, (k, v), strict=True):
            rows = new.reshape(new.shape[0], -1).index_select(0, self.write_rows)
            store.view(store.shape[0], -1).index_copy_(0, self.write_slots, rows)
        if self.inner is not None:
            self.inner.after_kv_written(layer_id)
        out, lse = self.reader.attend(q, pool, scale)
        return self._merge(out, lse).to(q.dtype).flatten(1)

    def _merge(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """out [T, H, D], lse [T, H] of this rank -> the exact attention over every rank's keys."""
        started = time.perf_counter()
        mine = torch.cat([out, lse.unsqueeze(-1)], dim=-1).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.own.size)]
        dist.all_gather(parts, mine, group=self.group)
        if self.clock is not None:
            self.clock.seconds += time.perf_counter() - started
        stacked = torch.stack(parts)
        return combine(stacked[..., :-1], stacked[..., -1])[0]
