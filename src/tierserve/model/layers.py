"""Building blocks whose weights can be split across tensor-parallel ranks.

Every parameter carries a ``weight_loader(param, loaded, shard)`` that copies this rank's
slice of a checkpoint tensor, so the loader never needs to know the parallel layout.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.model.parallel import HeadShard, TensorParallel


class RMSNorm(nn.Module):
    """RMS norm computed in float32, cast back before the weight (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def copy_whole(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _attach(param: nn.Parameter, loader, num_shards: int = 1) -> nn.Parameter:
    """Gives ``param`` its loader and the number of checkpoint tensors stacked into it."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.num_shards = num_shards  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks; one or more stacked outputs.

    Checkpoint shard ``i`` (e.g. the gate, then the up projection) goes into stacked sub-matrix
    ``i``: this rank holds its rows ``[starts[i], starts[i] + local_sizes[i])``. ``split`` gives
    each rank an equal block of every output.
    """

    def __init__(self, in_features: int, local_sizes: list[int], starts: list[int], bias: bool) -> None:
        super().__init__()
        self.local_sizes, self.starts = local_sizes, starts
        out, n = sum(local_sizes), len(local_sizes)
        self.weight = _attach(nn.Parameter(torch.empty(out, in_features)), self._load, n)
        self.bias = _attach(nn.Parameter(torch.zeros(out)), self._load, n) if bias else None

    @classmethod
    def split(cls, in_features: int, output_sizes: list[int], bias: bool, tp: TensorParallel) -> ColumnParallelLinear:
        """Each stacked output split evenly: rank r holds the r-th of ``tp.size`` equal row blocks."""
        local = [tp.shard(n, "output features") for n in output_sizes]
        return cls(in_features, local, [tp.rank * n for n in local], bias)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        index = shard or 0
        size = self.local_sizes[index]
        offset = sum(self.local_sizes[:index])
        piece = loaded.narrow(0, self.starts[index], size)
        copy_whole(param.data.narrow(0, offset, size), piece)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul; each rank holds the query and KV heads of its
    ``HeadShard`` (a replicated KV head is loaded by every rank that shares it)."""

    SHARDS: ClassVar[dict[str, int]] = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden: int, head_dim: int, heads: HeadShard, bias: bool) -> None:
        q, kv = heads.q_heads * head_dim, heads.kv_heads * head_dim
        q_start, kv_start = heads.q_start * head_dim, heads.kv_start * head_dim
        super().__init__(hidden, [q, kv, kv], [q_start, kv_start, kv_start], bias)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | str | None = None) -> None:
        super()._load(param, loaded, self.SHARDS[shard] if isinstance(shard, str) else shard)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.local_in = tp.shard(in_features, "input features")
        self.weight = _attach(nn.Parameter(torch.empty(out_features, self.local_in)), self._load_weight)
        self.bias = _attach(nn.Parameter(torch.zeros(out_features)), copy_whole) if bias else None

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        copy_whole(param, loaded.narrow(1, self.tp.rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class Embedding(nn.Module):
    """Token embedding, replicated on every rank (small next to the layers for our models)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.weight = _attach(nn.Parameter(torch.empty(vocab, hidden)), copy_whole)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up stacked in one column-parallel matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.split(hidden, [intermediate, intermediate], bias, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
