"""How a model splits over tensor-parallel ranks: heads (KV heads replicated when ranks outnumber
them), refused sizes that name the numbers, each rank's slice of the checkpoint, and the batch
digest that stops a rank which scheduled another batch than rank 0."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import make_tiny_model
from safetensors import safe_open

from tierserve.core.model_config import ModelConfig
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.procs.ranks import RankSpec, join, leave, rendezvous
from tierserve.engine.procs.token_share import FollowerSampler, LeaderSampler, RankDivergenceError, batch_digest
from tierserve.engine.request import Request
from tierserve.engine.scheduler import Scheduled
from tierserve.model.loader import load_model
from tierserve.model.parallel import HeadShard, TensorParallel, TensorParallelError, check_heads, check_model


@pytest.mark.parametrize(("heads", "kv_heads", "size", "rank", "want"), [
    (8, 4, 1, 0, HeadShard(0, 8, 0, 4)),
    (8, 4, 2, 1, HeadShard(4, 4, 2, 2)),
    (8, 8, 4, 3, HeadShard(6, 2, 6, 2)),
    (8, 2, 4, 0, HeadShard(0, 2, 0, 1)),  # 4 ranks, 2 KV heads: ranks 0 and 1 share head 0
    (8, 2, 4, 1, HeadShard(2, 2, 0, 1)),
    (8, 2, 4, 2, HeadShard(4, 2, 1, 1)),
    (8, 1, 8, 7, HeadShard(7, 1, 0, 1)),  # multi-query: every rank holds the one KV head
])
def test_heads_of_a_rank(heads: int, kv_heads: int, size: int, rank: int, want: HeadShard) -> None:
    assert TensorParallel(rank, size).heads(heads, kv_heads) == want


@pytest.mark.parametrize(("heads", "kv_heads", "size", "message"), [
    (8, 4, 3, "tensor-parallel size 3 does not divide the model's 8 attention heads"),
    (12, 6, 4, "tensor-parallel size 4 does not divide the model's 6 KV heads"),
    (12, 4, 6, "tensor-parallel size 6 is above the model's 4 KV heads but not a multiple of them"),
    (8, 4, 0, "must be at least 1"),
])
def test_sizes_that_fit_neither_split_are_refused(heads: int, kv_heads: int, size: int, message: str) -> None:
    with pytest.raises(TensorParallelError, match=message):
        check_heads(heads, kv_heads, size)


def test_the_mlp_must_split_too(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(make_tiny_model("llama", tmp_path, heads=8, kv_heads=8))
    check_model(cfg, 8)
    with pytest.raises(TensorParallelError, match="size 8 does not divide the model's intermediate size 100"):
        check_model(dataclasses.replace(cfg, intermediate_size=100), 8)


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict


@pytest.mark.parametrize(("family", "kv_heads", "size"), [("qwen2", 4, 2), ("qwen3", 2, 4)])
def test_each_rank_loads_its_slice_of_the_checkpoint(tmp_path: Path, family: str, kv_heads: int,
                                                     size: int) -> None:
    """Query heads split evenly, KV heads split or (fewer than the ranks) replicated; rows of
    gate/up, columns of o/down; Qwen2's q/k/v biases follow their heads."""
    model_dir = make_tiny_model(family, tmp_path, heads=8, kv_heads=kv_heads)
    ckpt, cfg = _checkpoint(model_dir), ModelConfig.from_dir(model_dir)
    d, layer = cfg.head_dim, "model.layers.1"
    for rank in range(size):
        tp = TensorParallel(rank, size)
        shard = tp.heads(cfg.num_heads, cfg.num_kv_heads)
        ours = load_model(model_dir, torch.device("cpu"), torch.float32, tp).layers["1"]
        q, k, v = (ckpt[f"{layer}.self_attn.{n}_proj.weight"] for n in "qkv")
        want_qkv = torch.cat([q[shard.q_start * d:][:shard.q_heads * d], k[shard.kv_start * d:][:shard.kv_heads * d],
                              v[shard.kv_start * d:][:shard.kv_heads * d]])
        assert torch.equal(ours.self_attn.qkv_proj.weight, want_qkv)
        o = ckpt[f"{layer}.self_attn.o_proj.weight"]
        assert torch.equal(ours.self_attn.o_proj.weight, o[:, shard.q_start * d:][:, :shard.q_heads * d])
        if family == "qwen2":
            qb, kb = ckpt[f"{layer}.self_attn.q_proj.bias"], ckpt[f"{layer}.self_attn.k_proj.bias"]
            bias = ours.self_attn.qkv_proj.bias
            assert torch.equal(bias[: shard.q_heads * d], qb[shard.q_start * d:][:shard.q_heads * d])
            k_bias = bias[shard.q_heads * d:][: shard.kv_heads * d]
            assert torch.equal(k_bias, kb[shard.kv_start * d:][:shard.kv_heads * d])
        rows = cfg.intermediate_size // size
        gate = ckpt[f"{layer}.mlp.gate_proj.weight"][rank * rows:][:rows]
        assert torch.equal(ours.mlp.gate_up_proj.weight[:rows], gate)
        down = ckpt[f"{layer}.mlp.down_proj.weight"][:, rank * rows:][:, :rows]
        assert torch.equal(ours.mlp.down_proj.weight, down)


def _batch(pages: list[int]) -> list[Scheduled]:
    request = Request("r1", [5, 6, 7, 8], SamplingParams(max_tokens=2))
    request.pages = pages
    return [Scheduled(request, 4)]


def test_the_batch_digest_sees_ids_counts_and_pages() -> None:
    digests = {batch_digest(_batch([0, 1])), batch_digest(_batch([0, 2])), batch_digest([])}
    assert len(digests) == 3 and batch_digest(_batch([0, 1])) == batch_digest(_batch([0, 1]))


def _share(rank: int, port: int, pages: list[int], out: mp.SimpleQueue) -> None:
    ranks = join(RankSpec(rank, 2, port, 30.0), EngineConfig(Path(), device="cpu", tp_size=2))
    share = LeaderSampler(ranks) if rank == 0 else FollowerSampler(ranks)
    try:
        out.put((rank, share.share(_batch(pages), 1, lambda: [42])))
    except RankDivergenceError as exc:
        out.put((rank, str(exc)))
    leave()


@pytest.mark.integration
@pytest.mark.parametrize(("follower_pages", "want"), [([3], [42]), ([4], "rank 1 scheduled another batch than rank 0")])
def test_a_rank_that_scheduled_another_batch_stops(follower_pages: list[int], want: object) -> None:
    """Rank 0's sampled tokens reach the other ranks with its batch digest; another batch raises."""
    ctx = mp.get_context("spawn")
    store, out = rendezvous(2, 30.0), ctx.SimpleQueue()
    pages = {0: [3], 1: follower_pages}
    procs = [ctx.Process(target=_share, args=(r, store.port, pages[r], out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert dict(out.get() for _ in procs) == {0: [42], 1: want}
