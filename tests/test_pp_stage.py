"""Pipeline placement without processes (``docs/pp.md``): which rank
is which stage and which layers a stage holds (vLLM's default split, or the partition given, checked
before anything starts), and that a stage loads only its part of the checkpoint, its layers indexing
its own KV pool from 0."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import make_tiny_model

from tierserve.cli.flags import engine_flags
from tierserve.core.layer_split import PipelineParallelError, check_layers, default_split, layer_partition
from tierserve.engine.config import EngineConfig
from tierserve.engine.procs.ranks import Ranks
from tierserve.model.loader import load_model
from tierserve.model.parallel import TensorParallel, misfit
from tierserve.model.pipeline import PipelineStage, stage_of


def test_ranks_are_tensor_ranks_within_stages() -> None:
    assert stage_of(1, tp_size=2, pp_size=2) == PipelineStage(0, 2, prev=None, next=3)
    assert stage_of(3, tp_size=2, pp_size=2) == PipelineStage(1, 2, prev=1, next=None)
    assert stage_of(2, tp_size=1, pp_size=4) == PipelineStage(2, 4, prev=1, next=3)
    ranks = Ranks(TensorParallel(1, 2), torch.device("cpu"), pp=stage_of(3, 2, 2))
    assert (ranks.rank, ranks.size, ranks.sampler) == (3, 4, 2)  # tensor rank 0 of the last stage samples


def test_stages_own_contiguous_layer_ranges() -> None:
    assert [PipelineStage(s, 3).layers(6) for s in range(3)] == [range(0, 2), range(2, 4), range(4, 6)]
    assert [PipelineStage(s, 3).layers(4) for s in range(3)] == [range(0, 1), range(1, 3), range(3, 4)]
    assert [PipelineStage(s, 2, partition=(1, 4)).layers(5) for s in range(2)] == [range(0, 1), range(1, 5)]
    assert stage_of(1, 1, 2, partition=(1, 2)).layers(3) == range(1, 3)


def test_the_default_split_is_vllms() -> None:
    """The extra layers go to the stages just before the last (vLLM's ``get_pp_indices``): never the
    last (final norm and LM head), the first only when every other stage but the last has one."""
    assert [default_split(layers, size) for layers, size in ((3, 2), (5, 2), (4, 3), (5, 3), (61, 2), (10, 4))] == \
        [(2, 1), (3, 2), (1, 2, 1), (2, 2, 1), (31, 30), (2, 3, 3, 2)]
    assert default_split(8, 4) == (2, 2, 2, 2)


@pytest.mark.parametrize(("layers", "size", "partition", "error"), [
    (4, 5, None, "pipeline-parallel size 5 is above the model's 4 layers: a stage would hold none"),
    (4, 2, (2, 1), "the layer partition 2,1 adds up to 3 layers, but the model has 4"),
    (4, 2, (1, 1, 2), "the layer partition 1,1,2 names 3 stage(s), but the pipeline-parallel size is 2"),
    (4, 2, (4, 0), "the layer partition 4,0 leaves a stage without layers"),
    (4, 0, None, "pipeline-parallel size must be at least 1, not 0"),
], ids=["above-layers", "bad-sum", "wrong-count", "empty-stage", "size-0"])
def test_splits_the_layers_cannot_take_are_refused(layers: int, size: int, partition: tuple[int, ...] | None,
                                                     error: str) -> None:
    with pytest.raises(PipelineParallelError, match=re.escape(error)):
        check_layers(layers, size, partition)


def test_the_partition_flag_is_checked_by_the_config_and_passed_on() -> None:
    """What needs no model (count, empty stages) fails when the config is built; the sum against the
    model's layers in ``misfit``; ``up`` forwards the partition as typed."""
    assert layer_partition("11,10,10") == (11, 10, 10)
    with pytest.raises(ValueError, match="not a comma-separated list of layer counts: '2;1'"):
        layer_partition("2;1")
    with pytest.raises(ValueError, match="--pp-layer-partition: the layer partition 2,1 names 2 stage"):
        EngineConfig(Path(), pp_layer_partition=(2, 1))
    with pytest.raises(ValueError, match="--pp-layer-partition: the layer partition 0,3 leaves a stage"):
        EngineConfig(Path(), pp_size=2, pp_layer_partition=(0, 3))
    config = EngineConfig(Path(), pp_size=2, pp_layer_partition=(1, 2))
    assert engine_flags(config) == ["--pp-size", "2", "--pp-layer-partition", "1,2"]
    assert config.layout_flags == "--tp-size 1 --pp-size 2 --pp-layer-partition 1,2"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), layers=4)


def test_misfit_names_stages_the_layers_cannot_fill(model: Path) -> None:
    assert misfit(model, 1, 2) is None and misfit(model, 1, 3) is None and misfit(model, 1, 2, (3, 1)) is None
    assert misfit(model, 1, 5) == "pipeline-parallel size 5 is above the model's 4 layers: a stage would hold none"
    assert misfit(model, 1, 2, (2, 3)) == "the layer partition 2,3 adds up to 5 layers, but the model has 4"


def test_each_stage_loads_its_layers_and_indexes_its_pool_from_zero(model: Path) -> None:
    cpu = torch.device("cpu")
    whole = load_model(model, cpu, torch.float32)
    first, last = (load_model(model, cpu, torch.float32, pp=PipelineStage(s, 2)) for s in range(2))
    assert list(first.layers) == ["0", "1"] and list(last.layers) == ["2", "3"]
    assert first.embed_tokens is not None and first.norm is None and first.lm_head is None
    assert last.embed_tokens is None and last.norm is not None and last.lm_head is not None
    assert [layer.self_attn.attn.layer_id for layer in last.layers.values()] == [0, 1]
    mine = dict(last.named_parameters())
    for name, param in whole.named_parameters():
        if name in mine:
            assert torch.equal(mine[name], param), name
    assert set(mine) | set(dict(first.named_parameters())) == set(dict(whole.named_parameters()))


def test_uneven_stages_load_their_layers(model: Path) -> None:
    """PP 3 on 4 layers: 1, 2 and 1 layers; the middle stage's second layer is its pool's layer 1."""
    stages = [load_model(model, torch.device("cpu"), torch.float32, pp=PipelineStage(s, 3)) for s in range(3)]
    assert [list(stage.layers) for stage in stages] == [["0"], ["1", "2"], ["3"]]
    assert [layer.self_attn.attn.layer_id for layer in stages[1].layers.values()] == [0, 1]
    assert stages[1].embed_tokens is None and stages[1].lm_head is None
