"""Where each rank of a TP x CP x PP node sits and which ranks share each group, without processes
(``docs/ranks.md``, rank numbering; ``docs/cp.md``, composed with TP and PP): the numbering, the
groups each rank joins, the pipeline peers, the sampling rank, each rank's L3 shard, and the
config that lets CP compose."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.cache.sharded.shards import HeadRange, KVShard, LayerRange
from tierserve.engine.config import EngineConfig
from tierserve.engine.procs.rank_layout import RankLayout, RankPlace
from tierserve.engine.procs.ranks import Ranks, nccl_settings
from tierserve.model.parallel import TensorParallel
from tierserve.model.pipeline import PipelineStage, stage_of

LAYOUTS = [RankLayout(tp, cp, pp) for tp, cp, pp in itertools.product((1, 2, 4), (1, 2, 3), (1, 2, 3))]


def _partition(groups: list[list[int]], size: int) -> bool:
    return sorted(r for g in groups for r in g) == list(range(size))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lo: f"tp{lo.tp}cp{lo.cp}pp{lo.pp}")
def test_every_rank_has_one_place_and_its_groups_partition_the_node(layout: RankLayout) -> None:
    places = [layout.place(r) for r in range(layout.size)]
    assert [layout.rank(p) for p in places] == list(range(layout.size))
    assert len(set(places)) == layout.size
    tensor, cp = layout.tensor_groups(), layout.cp_groups()
    assert _partition(tensor, layout.size) and _partition(cp, layout.size)
    for rank, p in enumerate(places):
        mine = tensor[layout.tensor_group_of(rank)]
        assert rank in mine and {(layout.place(r).cp, layout.place(r).stage) for r in mine} == {(p.cp, p.stage)}
        assert [layout.place(r).tp for r in mine] == list(range(layout.tp))  # in tensor-rank order
        peers = cp[layout.cp_group_of(rank)]
        assert rank in peers and {(layout.place(r).tp, layout.place(r).stage) for r in peers} == {(p.tp, p.stage)}
        assert [layout.place(r).cp for r in peers] == list(range(layout.cp))  # group rank = CP rank


def test_the_numbering_keeps_tensor_ranks_together_then_cp_ranks_then_stages() -> None:
    layout = RankLayout(tp=2, cp=2, pp=2)
    assert [layout.place(r) for r in (0, 1, 2, 3, 4, 7)] == [
        RankPlace(0, 0, 0), RankPlace(1, 0, 0), RankPlace(0, 1, 0), RankPlace(1, 1, 0), RankPlace(0, 0, 1),
        RankPlace(1, 1, 1)]
    assert layout.tensor_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.sampler == 4
    with pytest.raises(ValueError, match="rank 8 is not in a node of 8 ranks"):
        layout.place(8)


def test_without_cp_the_numbering_is_that_of_tp_x_pp() -> None:
    """A TP x PP node's ranks keep their numbers (``stage_of``'s ``s * T + t``)."""
    layout = RankLayout(tp=2, pp=3)
    assert all(layout.place(r) == RankPlace(r % 2, 0, r // 2) for r in range(6))


@pytest.mark.parametrize(("tp", "cp", "pp"), [(2, 2, 2), (1, 2, 2), (4, 3, 2)])
def test_a_stage_sends_to_the_same_tensor_and_cp_rank_of_the_next(tp: int, cp: int, pp: int) -> None:
    layout = RankLayout(tp, cp, pp)
    for rank in range(layout.size):
        stage, p = stage_of(rank, layout.stage_width, pp), layout.place(rank)
        assert stage.stage == p.stage
        for peer in (stage.prev, stage.next):
            if peer is not None:
                q = layout.place(peer)
                assert (q.tp, q.cp, abs(q.stage - p.stage)) == (p.tp, p.cp, 1)


def test_a_ranks_view_numbers_itself_as_the_layout_does() -> None:
    """Tensor rank 1 of CP rank 1 of stage 1 at TP 2 x CP 2 x PP 2 is rank 7; tensor rank 0 of CP
    rank 0 of the last stage (rank 4) samples; its L3 shard is its heads of its stage's layers."""
    ranks = Ranks(TensorParallel(1, 2), torch.device("cpu"), pp=PipelineStage(1, 2), cp=PageOwnership(1, 2))
    assert (ranks.rank, ranks.size, ranks.sampler) == (7, 8, 4)
    shard = ranks.kv_shard(TensorParallel(1, 2).heads(8, 4), 4, 4)
    assert shard == KVShard(HeadRange(2, 2, 4), 7, True, 8, layers=LayerRange(2, 2, 4))


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_cp_composes_with_tp_and_pp_in_the_config(tp: int, pp: int) -> None:
    config = EngineConfig(model_dir=Path("m"), tp_size=tp, pp_size=pp, cp_size=2)
    assert config.num_ranks == tp * pp * 2


def test_a_cp_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="cp_size must be at least 1"):
        EngineConfig(model_dir=Path("m"), cp_size=0)


def test_nccl_groups_abort_and_exit_on_a_timeout_and_the_monitor_waits_past_it() -> None:
    """A CUDA rank's NCCL settings (``nccl_settings``, set before its groups form; ``test_gpu.py`` joins
    one): a timed-out collective aborts the communicator and ends the process, as a gloo rank's error
    does; the heartbeat monitor gives the collective's own timeout its chance first."""
    for timeout_s in (10.0, 120.0, 600.0):
        settings = nccl_settings(timeout_s)
        assert settings["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and settings["TORCH_NCCL_ENABLE_MONITORING"] == "1"
        assert int(settings["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]) >= 2 * timeout_s
