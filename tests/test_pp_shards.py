"""L3 objects by layer range (``cache.shards``, ``cache.shard_io``): every pipeline stage of every
TP x PP size reads its heads of its layers from what any other TP x PP size wrote."""

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

HEADS, LAYERS, PAGES = 4, 4, 5
KEYS = page_keys(b"p" * 32, list(range(PAGES * 2)), 2)
SIZES = [(1, 1), (1, 2), (2, 2), (1, 4), (4, 1)]  # (TP, PP)


def _ranks(tp: int, pp: int) -> list[KVShard]:
    """Every rank's shard of a TP x PP node: stage-major, as ``Ranks.kv_shard`` makes them."""
    heads, layers = HEADS // tp, LAYERS // pp
    return [KVShard(HeadRange(t * heads, heads, HEADS), s * tp + t, True, tp * pp,
                    layers=LayerRange(s * layers, layers, LAYERS)) for s in range(pp) for t in range(tp)]


def _pool(shard: KVShard, layout: HostLayout) -> tuple[HostKVPool, ShardIO]:
    geometry = KVGeometry(shard.layers.count, shard.heads.count, 3, 2, torch.float32)
    host = HostKVPool(geometry, PAGES, layout)
    return host, ShardIO(host, page_io(host), shard)


def _mine(ref: torch.Tensor, shard: KVShard) -> torch.Tensor:
    """The shard's layers and heads of ``ref`` [L, 2, pages, page_size, heads, head_dim]."""
    h, la = shard.heads, shard.layers
    return ref[la.start : la.end, ..., h.start : h.end, :]


@pytest.mark.parametrize("layout", [HostLayout.PAGE_FIRST_DIRECT, HostLayout.LAYER_FIRST])
@pytest.mark.parametrize("writer", SIZES)
@pytest.mark.parametrize("reader", SIZES)
def test_every_tp_pp_size_reads_every_other(tmp_path: Path, writer: tuple[int, int], reader: tuple[int, int],
                                            layout: HostLayout) -> None:
    store = FileStorage(tmp_path)
    ref = torch.randn(LAYERS, 2, PAGES, 2, HEADS, 3, generator=torch.Generator().manual_seed(1))
    for shard in _ranks(*writer):
        host, io = _pool(shard, layout)
        host.run_all_layers(0, PAGES).copy_(_mine(ref, shard))
        assert all(io.set_from(store, KEYS, list(range(PAGES))))
    for shard in _ranks(*reader):
        host, io = _pool(shard, layout)
        probed, source = io.probe(store, KEYS)
        assert probed == PAGES and source.direct == (writer == reader)
        pages = [3, 1, 4, 0, 2]
        assert all(io.get_into(store, source, KEYS, pages))
        assert torch.equal(host.run_all_layers(0, PAGES)[:, :, pages], _mine(ref, shard))


def test_a_stage_names_its_objects_by_layer_range() -> None:
    """A stage's object is named by its layers; a node without stages keeps the head range's name."""
    half, every = HeadRange(0, 2, HEADS), LayerRange(0, LAYERS, LAYERS)
    first, second = LayerRange(0, 2, LAYERS), LayerRange(2, 2, LAYERS)
    assert object_key(KEYS[0], half, every) == object_key(KEYS[0], half)
    names = {object_key(KEYS[0], h, la) for h in (half, HeadRange(0, 4, 4)) for la in (first, second, every)}
    assert len(names) == 6
