"""One rank's place in its node: process groups, device, tensor-parallel shard and pipeline stage.

A node of ``tp_size`` T and ``pp_size`` S (or ``cp_size`` C, never both) is T * S (T * C) processes
(``docs/ranks.md``, ``docs/pp.md``, ``docs/cp.md``); rank ``s * T + t`` is tensor rank
t of stage s (of CP rank s). Rank 0 hosts the
rendezvous store; every rank joins the model's group (NCCL on CUDA, gloo on CPU) and a gloo
control group for the CPU messages that keep the ranks in step. Every group has a timeout, so no
rank waits in a collective for ever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum

import torch
import torch.distributed as dist

from tierserve.cache.sharded.agreement import Agreement, CollectiveMin, SingleRank
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.cache.sharded.shards import HeadRange, KVShard, LayerRange
from tierserve.engine.config import EngineConfig
from tierserve.model.parallel import HeadShard, TensorParallel
from tierserve.model.pipeline import SOLE, PipelineStage, stage_of

HOST = "127.0.0.1"  # all ranks of a node run on one machine


class Backend(Enum):
    """The collective library of the model's group."""

    GLOO = "gloo"
    NCCL = "nccl"


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to join its node: its rank, the node's size, the rendezvous store's port
    on ``HOST`` and the timeout of every collective."""

    rank: int
    size: int  # every rank of the node: tp_size * pp_size * cp_size
    store_port: int
    timeout_s: float


@dataclass(frozen=True)
class Ranks:
    """One rank's view of its node: its shard (``tp``), its device, ``control``, the gloo group of
    CPU messages over every rank (None: the default group, itself gloo on CPU), its pipeline stage
    (``pp``) and its share of the KV pages (``cp``, docs/cp.md; a node
    has stages or CP ranks, never both). ``rank`` and ``size`` count every rank of the node."""

    tp: TensorParallel
    device: torch.device
    control: dist.ProcessGroup | None = None
    pp: PipelineStage = SOLE
    cp: PageOwnership = field(default_factory=PageOwnership)
    cp_merge: dist.ProcessGroup | None = None  # CP: the merged attention's own group, not queued behind gathers

    @property
    def rank(self) -> int:
        return (self.pp.stage + self.cp.rank) * self.tp.size + self.tp.rank  # one of the two is 0

    @property
    def size(self) -> int:
        return self.tp.size * self.pp.size * self.cp.size

    @property
    def sampler(self) -> int:
        """The rank that computes logits and samples: tensor rank 0 of the last stage."""
        return (self.pp.size - 1) * self.tp.size

    def agreement(self) -> Agreement:
        """The cache's per-step agreement over the control group (its timeout bounds each call)."""
        return SingleRank() if self.size == 1 else CollectiveMin(self.control)

    def kv_shard(self, heads: HeadShard, num_kv_heads: int, num_layers: int) -> KVShard:
        """This rank's share of every KV page: its heads of its stage's layers; of the ranks that
        replicate one KV head (more ranks than KV heads) only the first writes its L3 objects. Its
        ``rank`` and ``ranks`` count every rank of the node (per-rank L3 settings and faults)."""
        replicas = max(1, self.tp.size // num_kv_heads)
        writes = self.tp.rank % replicas == 0
        stage = self.pp.layers(num_layers)
        layers = LayerRange(stage.start, len(stage), num_layers)
        return KVShard(HeadRange(heads.kv_start, heads.kv_heads, num_kv_heads), self.rank, writes, self.size,
                       layers=layers)

    def agree_min(self, value: int) -> int:
        """The minimum of ``value`` over all ranks (itself at size 1); every rank must call it."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    def all_gather(self, value: object) -> list[object]:
        """Every rank's picklable ``value``, by rank (``[value]`` at size 1); every rank must call
        it. Over the control group, so its timeout bounds the wait for a rank that never comes."""
        if self.size == 1:
            return [value]
        gathered: list[object] = [None] * self.size
        dist.all_gather_object(gathered, value, group=self.control)
        return gathered


def pick_device(name: str, rank: int = 0, base_gpu_id: int = 0) -> torch.device:
    """The device of ``rank``: ``auto`` is CUDA when present; CUDA without an index means the
    device ``base_gpu_id + rank``, one per rank."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if device.index is not None and (rank or base_gpu_id):
        raise ValueError(f"--device {name} names one device; use --device cuda --base-gpu-id N with --tp-size")
    return device if device.index is not None else torch.device("cuda", base_gpu_id + rank)


def single_rank(config: EngineConfig) -> Ranks:
    """The one rank of a node with ``tp_size`` and ``pp_size`` 1: no process group, no collective."""
    return Ranks(TensorParallel(), pick_device(config.device, 0, config.base_gpu_id))


def rendezvous(size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, on any free port of ``HOST`` (``store.port``), for the other ranks to join."""
    return dist.TCPStore(HOST, 0, size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def join(spec: RankSpec, config: EngineConfig, store: dist.Store | None = None) -> Ranks:
    """Joins the node's groups as ``spec.rank`` (rank 0 passes the store it hosts); returns the rank's
    view. Blocks until every rank joined or ``spec.timeout_s`` passed."""
    device = pick_device(config.device, spec.rank, config.base_gpu_id)
    timeout = timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(HOST, spec.store_port, spec.size, is_master=False, timeout=timeout)
    backend = Backend.NCCL if device.type == "cuda" else Backend.GLOO
    if backend is Backend.NCCL:
        torch.cuda.set_device(device)
    dist.init_process_group(backend.value, store=store, rank=spec.rank, world_size=spec.size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend is Backend.NCCL else None
    _share_cpu(device, spec.size)
    tp_group = _tensor_group(spec.rank, config.tp_size, config.pp_size, timeout)
    tp = TensorParallel(spec.rank % config.tp_size, config.tp_size, tp_group)
    stage = stage_of(spec.rank, config.tp_size, config.pp_size, partition=config.pp_layer_partition) \
        if config.pp_size > 1 else SOLE
    own = PageOwnership(spec.rank // config.tp_size, config.cp_size) if config.cp_size > 1 else PageOwnership()
    merge = dist.new_group(timeout=timeout) if config.cp_size > 1 else None
    return Ranks(tp, device, control, stage, own, merge)


def _tensor_group(rank: int, tp_size: int, pp_size: int, timeout: timedelta) -> dist.ProcessGroup | None:
    """The group of this rank's stage, for the tensor-parallel all-reduces: the default group
    when there is one stage. Every rank creates every stage's group, in stage order (as
    ``new_group`` requires), and keeps its own."""
    if pp_size == 1:
        return None
    groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), timeout=timeout) for s in range(pp_size)]
    return groups[rank // tp_size]


def leave() -> None:
    """Leaves the node's groups (after the last collective)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _share_cpu(device: torch.device, size: int) -> None:
    """On CPU the ranks share the cores: each computes with its share, not all of them each."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
