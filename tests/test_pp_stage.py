"""Pipeline placement without processes (``docs/pp.md``): which rank
is which stage and which layers a stage holds, and that a stage loads only its part of the
checkpoint, its layers indexing its own KV pool from 0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.tiny_models import make_tiny_model

from tierserve.engine.procs.ranks import Ranks
from tierserve.model.loader import load_model
from tierserve.model.parallel import TensorParallel, misfit
from tierserve.model.pipeline import PipelineParallelError, PipelineStage, check_layers, stage_of


def test_ranks_are_tensor_ranks_within_stages() -> None:
    assert stage_of(1, tp_size=2, pp_size=2) == PipelineStage(0, 2, prev=None, next=3)
    assert stage_of(3, tp_size=2, pp_size=2) == PipelineStage(1, 2, prev=1, next=None)
    assert stage_of(2, tp_size=1, pp_size=4) == PipelineStage(2, 4, prev=1, next=3)
    ranks = Ranks(TensorParallel(1, 2), torch.device("cpu"), pp=stage_of(3, 2, 2))
    assert (ranks.rank, ranks.size, ranks.sampler) == (3, 4, 2)  # tensor rank 0 of the last stage samples


def test_stages_own_contiguous_even_layer_ranges() -> None:
    assert [PipelineStage(s, 3).layers(6) for s in range(3)] == [range(0, 2), range(2, 4), range(4, 6)]
    with pytest.raises(PipelineParallelError, match="size 3 does not divide the model's 4 layers"):
        check_layers(4, 3)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), layers=4)


def test_misfit_names_a_pp_size_that_does_not_divide_the_layers(model: Path) -> None:
    assert misfit(model, 1, 2) is None
    assert misfit(model, 1, 3) == "pipeline-parallel size 3 does not divide the model's 4 layers"


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
