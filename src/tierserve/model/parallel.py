"""Tensor-parallel placement of this process; size 1 until tensor parallelism lands."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    """Which shard of every parallel layer this process holds.

    Layers take this explicitly (no global state) so several ranks can live in one
    process in tests. ``all_reduce`` sums a row-parallel layer's partial outputs.
    """

    rank: int = 0
    size: int = 1

    def shard(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor-parallel size {self.size}")
        return total // self.size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor
        torch.distributed.all_reduce(tensor)
        return tensor


SINGLE = TensorParallel()
