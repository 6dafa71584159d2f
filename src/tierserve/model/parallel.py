"""Tensor-parallel placement of one rank: which heads and rows of every parallel layer it holds.

Attention heads are split as SGLang splits them (``docs/tp.md``): each of N ranks
holds ``num_heads / N`` query heads; ``num_kv_heads / N`` KV heads when N divides them, else (N a
multiple of ``num_kv_heads``) one KV head that ``N / num_kv_heads`` neighbouring ranks share.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tierserve.core.layer_split import PipelineParallelError, check_layers
from tierserve.core.model_config import ModelConfig


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks; the message names the numbers."""


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: query heads ``[q_start, q_start + q_heads)`` and KV heads
    ``[kv_start, kv_start + kv_heads)`` of the checkpoint."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int


@dataclass(frozen=True)
class TensorParallel:
    """Which shard of every parallel layer this process holds.

    Layers take this explicitly (no global state) so several ranks can live in one process in
    tests. ``group`` is the ``torch.distributed`` group the ranks share (None: the default group);
    ``all_reduce`` sums a row-parallel layer's partial outputs, with no collective at size 1.
    """

    rank: int = 0
    size: int = 1
    group: torch.distributed.ProcessGroup | None = None

    def shard(self, total: int, what: str) -> int:
        if total % self.size:
            raise TensorParallelError(f"{what}={total} is not divisible by tensor-parallel size {self.size}")
        return total // self.size

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        """This rank's heads; ``TensorParallelError`` when the size fits neither split."""
        check_heads(num_heads, num_kv_heads, self.size)
        q_heads = num_heads // self.size
        return HeadShard(self.rank * q_heads, q_heads, *kv_heads_of(self.rank, self.size, num_kv_heads))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor
        torch.distributed.all_reduce(tensor, group=self.group)
        return tensor


SINGLE = TensorParallel()


def kv_heads_of(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """(first, count) of the KV heads rank ``rank`` of ``size`` holds: ``num_kv_heads / size`` each
    when ``size`` divides them, else one that ``size / num_kv_heads`` neighbouring ranks share."""
    if size <= num_kv_heads:
        count = num_kv_heads // size
        return rank * count, count
    return rank // (size // num_kv_heads), 1


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Raises ``TensorParallelError`` unless ``size`` ranks can split these attention heads."""
    if size < 1:
        raise TensorParallelError(f"tensor-parallel size must be at least 1, not {size}")
    if num_heads % size:
        raise TensorParallelError(
            f"tensor-parallel size {size} does not divide the model's {num_heads} attention heads")
    if size <= num_kv_heads and num_kv_heads % size:
        raise TensorParallelError(
            f"tensor-parallel size {size} does not divide the model's {num_kv_heads} KV heads")
    if size > num_kv_heads and size % num_kv_heads:
        raise TensorParallelError(
            f"tensor-parallel size {size} is above the model's {num_kv_heads} KV heads but not a multiple "
            f"of them, so the KV heads cannot be replicated evenly")


def check_model(cfg: ModelConfig, size: int) -> None:
    """Raises ``TensorParallelError`` unless ``cfg`` can be split over ``size`` ranks (heads and MLP)."""
    check_heads(cfg.num_heads, cfg.num_kv_heads, size)
    if cfg.intermediate_size % size:
        raise TensorParallelError(
            f"tensor-parallel size {size} does not divide the model's intermediate size {cfg.intermediate_size}")


def misfit(model_dir: Path, size: int, pp_size: int = 1, partition: tuple[int, ...] | None = None) -> str | None:
    """Why the model in ``model_dir`` cannot be split over ``size`` tensor ranks and ``pp_size``
    pipeline stages (of ``partition``'s layers, when given), or None when it can: the one check
    ``serve``, the node roles and ``up`` run before starting any process."""
    cfg = ModelConfig.from_dir(model_dir)
    try:
        check_model(cfg, size)
        check_layers(cfg.num_layers, pp_size, partition)
    except (TensorParallelError, PipelineParallelError) as exc:
        return str(exc)
    return None
