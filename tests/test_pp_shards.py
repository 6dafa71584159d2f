"""L3 objects by layer range (``cache.shards``, ``cache.shard_io``): every pipeline stage of every
TP x PP size reads its heads of its layers from what any other TP x PP size wrote, on models whose
layers the stages split evenly (4 layers) and unevenly (5 layers; 4 at PP 3), and a stage of a
partition the user gave reads them too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierserve.cache.device_pool import KVGeometry
from tierserve.cache.hashing import page_keys
from tierserve.cache.host_pool import HostKVPool, HostLayout
from tierserve.cache.sharded.shard_io import ShardIO
from tierserve.cache.sharded.shards import HeadRange, KVShard, LayerRange, object_key
from tierserve.cache.staging import page_io
from tierserve.cache.storage.file import FileStorage
from tierserve.model.pipeline import PipelineStage

HEADS, LAYERS, PAGES = 4, 4, 5
KEYS = page_keys(b"p" * 32, list(range(PAGES * 2)), 2)
SIZES = [(1, 1), (1, 2), (2, 2), (1, 3), (1, 4), (4, 1)]  # (TP, PP)


def _ranks(tp: int, pp: int, layers: int = LAYERS, partition: tuple[int, ...] | None = None) -> list[KVShard]:
    """Every rank's shard of a TP x PP node: stage-major, each stage's layers as ``PipelineStage``
    splits them, as ``Ranks.kv_shard`` makes them."""
    heads = HEADS // tp
    stages = [PipelineStage(s, pp, partition=partition).layers(layers) for s in range(pp)]
    return [KVShard(HeadRange(t * heads, heads, HEADS), s * tp + t, True, tp * pp,
                    layers=LayerRange(stages[s].start, len(stages[s]), layers)) for s in range(pp) for t in range(tp)]


def _pool(shard: KVShard, layout: HostLayout) -> tuple[HostKVPool, ShardIO]:
    geometry = KVGeometry(shard.layers.count, shard.heads.count, 3, 2, torch.float32)
    host = HostKVPool(geometry, PAGES, layout)
    return host, ShardIO(host, page_io(host), shard)


def _mine(ref: torch.Tensor, shard: KVShard) -> torch.Tensor:
    """The shard's layers and heads of ``ref`` [L, 2, pages, page_size, heads, head_dim]."""
    h, la = shard.heads, shard.layers
    return ref[la.start : la.end, ..., h.start : h.end, :]


@pytest.mark.parametrize("layout", [HostLayout.PAGE_FIRST_DIRECT, HostLayout.LAYER_FIRST])
@pytest.mark.parametrize("layers", [LAYERS, 5])
@pytest.mark.parametrize("writer", SIZES)
@pytest.mark.parametrize("reader", SIZES)
def test_every_tp_pp_size_reads_every_other(tmp_path: Path, writer: tuple[int, int], reader: tuple[int, int],
                                            layers: int, layout: HostLayout) -> None:
    written = _ranks(*writer, layers)
    _write(FileStorage(tmp_path), written, layout, layers)
    for shard in _ranks(*reader, layers):  # direct where a writer's stage holds exactly these heads and layers
        direct = any((w.heads, w.layers) == (shard.heads, shard.layers) for w in written)
        assert _read(FileStorage(tmp_path), shard, layout, layers) == direct


@pytest.mark.parametrize("writer", SIZES)
def test_a_stage_of_a_given_partition_reads_every_default_split(tmp_path: Path, writer: tuple[int, int]) -> None:
    """Stages of 1 + 4 layers (``--pp-layer-partition 1,4``) read what default splits wrote; a
    writer of that partition reads its own objects back zero-copy."""
    _write(FileStorage(tmp_path), _ranks(*writer, 5), HostLayout.PAGE_FIRST_DIRECT, 5)
    for shard in _ranks(1, 2, 5, (1, 4)):
        _read(FileStorage(tmp_path), shard, HostLayout.PAGE_FIRST_DIRECT, 5)
    _write(FileStorage(tmp_path / "own"), _ranks(1, 2, 5, (1, 4)), HostLayout.PAGE_FIRST_DIRECT, 5)
    for shard in _ranks(1, 2, 5, (1, 4)):
        assert _read(FileStorage(tmp_path / "own"), shard, HostLayout.PAGE_FIRST_DIRECT, 5)


def _reference(layers: int) -> torch.Tensor:
    return torch.randn(layers, 2, PAGES, 2, HEADS, 3, generator=torch.Generator().manual_seed(1))


def _write(store: FileStorage, shards: list[KVShard], layout: HostLayout, layers: int) -> None:
    ref = _reference(layers)
    for shard in shards:
        host, io = _pool(shard, layout)
        host.run_all_layers(0, PAGES).copy_(_mine(ref, shard))
        assert all(io.set_from(store, KEYS, list(range(PAGES))))


def _read(store: FileStorage, shard: KVShard, layout: HostLayout, layers: int) -> bool:
    """Reads every page of ``shard`` from ``store``, checks it against the reference; whether the
    read was direct (the writer's own objects)."""
    host, io = _pool(shard, layout)
    probed, source = io.probe(store, KEYS)
    assert probed == PAGES
    pages = [3, 1, 4, 0, 2]
    assert all(io.get_into(store, source, KEYS, pages))
    assert torch.equal(host.run_all_layers(0, PAGES)[:, :, pages], _mine(_reference(layers), shard))
    return source.direct


def test_a_stage_names_its_objects_by_layer_range() -> None:
    """A stage's object is named by its layers; a node without stages keeps the head range's name."""
    half, every = HeadRange(0, 2, HEADS), LayerRange(0, LAYERS, LAYERS)
    first, second = LayerRange(0, 2, LAYERS), LayerRange(2, 2, LAYERS)
    assert object_key(KEYS[0], half, every) == object_key(KEYS[0], half)
    names = {object_key(KEYS[0], h, la) for h in (half, HeadRange(0, 4, 4)) for la in (first, second, every)}
    assert len(names) == 6
