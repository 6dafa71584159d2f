"""One rank's place in its node: process groups, device, tensor-parallel shard and pipeline stage.

A node of ``tp_size`` T, ``cp_size`` C and ``pp_size`` S is T * C * S processes (``docs/ranks.md``,
``docs/pp.md``, ``docs/cp.md``); rank ``(s * C + c) * T + t`` is tensor rank t of CP rank c of stage s
(``RankLayout``). Rank 0 hosts the rendezvous store; every rank joins the model's group (NCCL on CUDA,
gloo on CPU), a gloo control group over every rank for the CPU messages that keep the ranks in step,
and the explicit groups of its place: its tensor group (same CP rank and stage), its CP groups (same
tensor rank and stage: gathers, merged attention) and its pipeline peers (same tensor and CP rank).
Every group has a timeout, so no rank waits in a collective for ever.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from enum import Enum

import torch
import torch.distributed as dist

from tierserve.cache.sharded.agreement import Agreement, CollectiveMin, SingleRank
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.cache.sharded.shards import HeadRange, KVShard, LayerRange
from tierserve.core.test_hooks import JOIN_LAG, JOINED_LAG, injected_lag
from tierserve.engine.config import EngineConfig
from tierserve.engine.procs.rank_layout import RankLayout, RankPlace
from tierserve.model.parallel import HeadShard, TensorParallel
from tierserve.model.pipeline import SOLE, PipelineStage, stage_of

HOST = "127.0.0.1"  # all ranks of a node run on one machine


class Backend(Enum):
    """The collective library of the model's group."""

    GLOO = "gloo"
    NCCL = "nccl"


STARTUP_TIMEOUT_S = 300.0  # how long a node's ranks may take to start before they give up on each other


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
    (``pp``), its share of the KV pages (``cp``, docs/cp.md) and the groups of the CP ranks that hold
    its heads of its layers (``cp_group`` for gathers, ``cp_merge`` for merged attention; None: the
    default group, which is only right when the CP ranks are the whole node). ``rank`` and ``size``
    count every rank of the node, numbered as ``RankLayout`` says."""

    tp: TensorParallel
    device: torch.device
    control: dist.ProcessGroup | None = None
    pp: PipelineStage = SOLE
    cp: PageOwnership = field(default_factory=PageOwnership)
    cp_merge: dist.ProcessGroup | None = None  # CP: the merged attention's own group, not queued behind gathers
    cp_group: dist.ProcessGroup | None = None  # CP: the per-layer gathers' group
    step_timeout_s: float | None = None  # --dist-timeout, given to every group by ``started`` (None: one rank)

    def started(self) -> None:
        """The engine on this rank is built: every collective from now on is a step's, bounded by
        ``--dist-timeout``; those of the start (joining, the engine's agreements) had the start's
        timeout, since a rank slow to start (a loaded machine) is not a frozen one."""
        if self.step_timeout_s is not None:
            _bound_collectives(self, timedelta(seconds=self.step_timeout_s))

    @property
    def layout(self) -> RankLayout:
        return RankLayout(self.tp.size, self.cp.size, self.pp.size)

    @property
    def rank(self) -> int:
        return self.layout.rank(RankPlace(self.tp.rank, self.cp.rank, self.pp.stage))

    @property
    def size(self) -> int:
        return self.layout.size

    @property
    def sampler(self) -> int:
        """The rank that computes logits and samples: tensor rank 0 of CP rank 0 of the last stage."""
        return self.layout.sampler

    def agreement(self) -> Agreement:
        """The cache's per-step agreement over the control group (its timeout bounds each call)."""
        return SingleRank() if self.size == 1 else CollectiveMin(self.control)

    def kv_shard(self, heads: HeadShard, num_kv_heads: int, num_layers: int, draft_layers: int = 0) -> KVShard:
        """This rank's share of every KV page: its heads of its stage's layers of the model's
        ``num_layers``, and on the last stage the ``draft_layers`` a packed speculative draft adds
        after them (docs/speculative.md); of the ranks that replicate one KV head (more ranks than KV
        heads) only the first writes its L3 objects. Its ``rank`` and ``ranks`` count every rank of
        the node (per-rank L3 settings and faults)."""
        replicas = max(1, self.tp.size // num_kv_heads)
        writes = self.tp.rank % replicas == 0
        stage = self.pp.layers(num_layers)
        draft = draft_layers if self.pp.last else 0
        layers = LayerRange(stage.start, len(stage) + draft, num_layers + draft_layers)
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
    return dist.TCPStore(HOST, 0, size, is_master=True, timeout=_startup_timeout(timeout_s),
                         wait_for_workers=False)


def nccl_settings(timeout_s: float) -> dict[str, str]:
    """How a CUDA rank's NCCL groups fail (``docs/faults.md``): a collective past ``timeout_s`` (the
    ``--dist-timeout`` every group is made with) or an NCCL error aborts the communicator and ends the
    process (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 1; torch's default 3 ends it without the abort), so the
    rank exits as a gloo rank does and its node goes down; a watchdog thread itself stuck in a CUDA or
    NCCL call ends the process once no heartbeat came for twice that timeout (the monitor, after the
    collective's own timeout had its chance)."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ENABLE_MONITORING": "1",
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(max(60, int(2 * timeout_s)))}


def join(spec: RankSpec, config: EngineConfig, store: dist.Store | None = None) -> Ranks:
    """Joins the node's groups as ``spec.rank`` (rank 0 passes the store it hosts); returns the rank's
    view. Forming the groups is part of starting a rank, bounded by the start's timeout
    (``_startup_timeout``), and so are the engine's collectives while it is built; every collective
    after that by ``spec.timeout_s`` (``--dist-timeout``), once the engine calls ``Ranks.started``."""
    device = pick_device(config.device, spec.rank, config.base_gpu_id)
    startup = _startup_timeout(spec.timeout_s)
    if store is None:
        store = dist.TCPStore(HOST, spec.store_port, spec.size, is_master=False, timeout=startup)
    backend = Backend.NCCL if device.type == "cuda" else Backend.GLOO
    if backend is Backend.NCCL:
        torch.cuda.set_device(device)
        for name, value in nccl_settings(spec.timeout_s).items():
            os.environ.setdefault(name, value)  # read by ProcessGroupNCCL when the group forms; an operator's own win
    _wait_all_arrived(store, spec)
    if spec.rank > 0:
        time.sleep(injected_lag(JOIN_LAG))
    dist.init_process_group(backend.value, store=store, rank=spec.rank, world_size=spec.size, timeout=startup)
    ranks = _join_groups(spec, config, device, backend, startup)
    if spec.rank > 0:
        time.sleep(injected_lag(JOINED_LAG))
    return replace(ranks, step_timeout_s=spec.timeout_s)


def _join_groups(spec: RankSpec, config: EngineConfig, device: torch.device, backend: Backend,
                 timeout: timedelta) -> Ranks:
    """Creates the node's groups (every rank creates every group, in order) and returns this rank's."""
    control = dist.new_group(backend="gloo", timeout=timeout) if backend is Backend.NCCL else None
    _share_cpu(device, spec.size)
    layout = RankLayout(config.tp_size, config.cp_size, config.pp_size)
    place = layout.place(spec.rank)
    tp_group = _own_group(layout.tensor_groups(), layout.tensor_group_of(spec.rank), timeout)
    tp = TensorParallel(place.tp, config.tp_size, tp_group)
    # a stage's peers are the same tensor and CP rank of the next and previous stages: one stage width apart
    stage = stage_of(spec.rank, layout.stage_width, config.pp_size, partition=config.pp_layer_partition) \
        if config.pp_size > 1 else SOLE
    if config.cp_size == 1:
        return Ranks(tp, device, control, stage)
    # always new groups, even over the whole node: on NCCL a merge queued behind a gather on one
    # communicator would wait for it (docs/cp.md, merged attention)
    gathers = _new_groups(layout.cp_groups(), timeout)[layout.cp_group_of(spec.rank)]
    merges = _new_groups(layout.cp_groups(), timeout)[layout.cp_group_of(spec.rank)]
    return Ranks(tp, device, control, stage, PageOwnership(place.cp, config.cp_size), merges, gathers)


def _startup_timeout(timeout_s: float) -> timedelta:
    """How long a rank's start may take: ``STARTUP_TIMEOUT_S``, or the collective timeout if longer."""
    return timedelta(seconds=max(STARTUP_TIMEOUT_S, timeout_s))


def _bound_collectives(ranks: Ranks, timeout: timedelta) -> None:
    """Gives every group this rank is in the collective timeout once all formed: a rank frozen or slow
    while the groups form (a loaded machine) was waited for, one frozen in a step is not. torch has no
    public call for it; ``_set_pg_timeout`` sets the backend's default timeout, read by each collective."""
    groups = {None, ranks.control, ranks.tp.group, ranks.cp_merge, ranks.cp_group}
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def _wait_all_arrived(store: dist.Store, spec: RankSpec) -> None:
    """Waits until every rank of the node reached its join, at most the start's timeout: starting a
    rank (imports, device, a loaded machine) is not a step, so ``--dist-timeout`` must not bound it.
    A rank that dies meanwhile takes the node down through the watchdog (docs/ranks.md)."""
    store.set(f"arrived/{spec.rank}", b"1")
    store.wait([f"arrived/{rank}" for rank in range(spec.size)], _startup_timeout(spec.timeout_s))


def _own_group(groups: list[list[int]], mine: int, timeout: timedelta) -> dist.ProcessGroup | None:
    """Group ``mine`` of ``groups`` (a partition of the node's ranks): the default group when it is the
    only one, None too when it is one rank (no collective runs over it). Every rank creates every
    group, in order (as ``new_group`` requires), and keeps its own."""
    return None if len(groups) == 1 or len(groups[mine]) == 1 else _new_groups(groups, timeout)[mine]


def _new_groups(groups: list[list[int]], timeout: timedelta) -> list[dist.ProcessGroup]:
    """One process group per list of ranks, created in order on every rank."""
    return [dist.new_group(ranks, timeout=timeout) for ranks in groups]


def leave() -> None:
    """Leaves the node's groups (after the last collective)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _share_cpu(device: torch.device, size: int) -> None:
    """On CPU the ranks share the cores: each computes with its share, not all of them each."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
