"""L3 objects by head range: every TP size reads what any other wrote (``cache.shards``, ``cache.shard_io``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.injected_faults import write_faults

from tierserve.cache.device_pool import KVGeometry
from tierserve.cache.hashing import page_keys
from tierserve.cache.host_pool import HostKVPool, HostLayout
from tierserve.cache.sharded.shard_io import ShardIO
from tierserve.cache.sharded.shards import (
    HeadRange,
    KVShard,
    LayerRange,
    Piece,
    covering,
    finer_chunks,
    object_key,
    sources,
)
from tierserve.cache.staging import page_io
from tierserve.cache.storage.file import FileStorage
from tierserve.core.test_hooks import FAULTS_ENV

HEADS = 4
PAGES = 5
KEYS = page_keys(b"s" * 32, list(range(PAGES * 2)), 2)


def _geometry(heads: int) -> KVGeometry:
    return KVGeometry(num_layers=2, num_kv_heads=heads, head_dim=3, page_size=2, dtype=torch.float32)


def _shard(rank: int, size: int, cluster: tuple[int, ...] = ()) -> KVShard:
    count = max(1, HEADS // size)
    start = rank * count if size <= HEADS else rank // (size // HEADS)
    heads = HeadRange(start, count, HEADS)
    return KVShard(heads, rank, size <= HEADS or rank % (size // HEADS) == 0, finer=finer_chunks(heads, cluster))


def _pool(shard: KVShard, layout: HostLayout) -> tuple[HostKVPool, ShardIO]:
    host = HostKVPool(_geometry(shard.heads.count), PAGES, layout)
    return host, ShardIO(host, page_io(host), shard)


def _reference() -> torch.Tensor:
    """Every page's KV for all heads, [L, 2, pages, page_size, heads, head_dim]."""
    return torch.randn(2, 2, PAGES, 2, HEADS, 3, generator=torch.Generator().manual_seed(0))


def test_names_and_sources() -> None:
    whole, half, layers = HeadRange(0, 4, 4), HeadRange(2, 2, 4), LayerRange(0, 2, 2)
    assert object_key(KEYS[0], whole) == KEYS[0] and object_key(KEYS[0], half) != KEYS[0]
    assert object_key(KEYS[0], half, layers) == object_key(KEYS[0], half)  # every layer: named as without stages
    # own, then the whole page, then single heads; then the same for each layer (2 stages)
    assert [len(s.objects) for s in sources(Piece(half, layers))] == [1, 1, 2, 2, 2, 4]
    assert sources(Piece(half, layers))[0].direct and not sources(Piece(half, layers))[1].direct
    assert covering(Piece(HeadRange(1, 1, 4), layers), 2).objects == (Piece(HeadRange(0, 2, 4), layers),)
    with pytest.raises(ValueError):
        HeadRange(3, 2, 4)


def _write(store: FileStorage, size: int, ref: torch.Tensor, layout: HostLayout, cluster: tuple[int, ...] = ()) -> None:
    for rank in range(size):
        host, io = _pool(_shard(rank, size, cluster), layout)
        h = io.shard.heads
        host.run_all_layers(0, PAGES).copy_(ref[..., h.start : h.end, :])
        assert all(io.set_from(store, KEYS, list(range(PAGES))))


@pytest.mark.parametrize("layout", [HostLayout.PAGE_FIRST_DIRECT, HostLayout.LAYER_FIRST])
@pytest.mark.parametrize("writer", [1, 2, 4, 8])
@pytest.mark.parametrize("reader", [1, 2, 4, 8])
def test_every_tp_size_reads_every_other(tmp_path: Path, writer: int, reader: int, layout: HostLayout) -> None:
    store, ref = FileStorage(tmp_path), _reference()
    _write(store, writer, ref, layout)
    for rank in range(reader):
        host, io = _pool(_shard(rank, reader), layout)
        probed, source = io.probe(store, KEYS)
        assert probed == PAGES and source.direct == (max(1, HEADS // writer) == io.shard.heads.count)
        pages = [4, 0, 3, 1, 2]  # any host pages
        assert all(io.get_into(store, source, KEYS, pages))
        h = io.shard.heads
        assert torch.equal(host.run_all_layers(0, PAGES)[:, :, pages], ref[..., h.start : h.end, :])


def test_finer_chunks_are_the_smaller_shares_that_tile_a_range() -> None:
    from tierserve.cache.factory import cluster_shard

    assert finer_chunks(HeadRange(0, 4, 4), [1, 2, 4, 8]) == (2, 1)  # TP 8 ranks replicate single heads
    assert finer_chunks(HeadRange(2, 2, 4), [1, 2, 4]) == (1,)
    assert finer_chunks(HeadRange(0, 4, 4), [1]) == finer_chunks(HeadRange(0, 1, 4), [1, 2, 4]) == ()
    assert finer_chunks(HeadRange(4, 4, 8), [1, 2, 4]) == (2,)  # the TP=1 share is larger: not written
    assert cluster_shard(KVShard.whole(4), {"l3_tp_sizes": [1, 2]}).finer == (2,)
    assert cluster_shard(KVShard.whole(4), {}).finer == ()
    for bad in ([0], "2", [1.5]):
        with pytest.raises(ValueError):
            cluster_shard(KVShard.whole(4), {"l3_tp_sizes": bad})


@pytest.mark.parametrize("layout", [HostLayout.PAGE_FIRST_DIRECT, HostLayout.LAYER_FIRST])
def test_a_writer_told_the_cluster_tp_sizes_stores_their_shares(tmp_path: Path, layout: HostLayout) -> None:
    """A TP=1 writer told TP sizes 1, 2 and 4 also stores halves and quarters of every page: the
    TP=2 and TP=4 ranks read them as their own objects (direct, zero-copy), the same bytes."""
    store, ref = FileStorage(tmp_path), _reference()
    _write(store, 1, ref, layout, cluster=(1, 2, 4))
    for size in (1, 2, 4):
        for rank in range(size):
            host, io = _pool(_shard(rank, size), layout)
            probed, source = io.probe(store, KEYS)
            assert probed == PAGES and source.direct and source == io.own
            pages = [2, 4, 0, 1, 3]
            assert all(io.get_into(store, source, KEYS, pages))
            h = io.shard.heads
            assert torch.equal(host.run_all_layers(0, PAGES)[:, :, pages], ref[..., h.start : h.end, :])


def test_finer_objects_only_for_pages_whose_own_object_stored(tmp_path: Path) -> None:
    """A page whose own object the store refused gets no finer objects: they would outlive it."""
    store = Refusing(tmp_path, refuse=KEYS[2])
    _, writer = _pool(_shard(0, 1, cluster=(2,)), HostLayout.PAGE_FIRST_DIRECT)
    assert writer.set_from(store, KEYS, list(range(PAGES))) == [True, True, False, True, True]
    for rank in (0, 1):
        _, io = _pool(_shard(rank, 2), HostLayout.PAGE_FIRST_DIRECT)
        assert store.exists_each(io.own.keys(KEYS)) == [True, True, False, True, True]


class Refusing(FileStorage):
    """Refuses to store one key."""

    def __init__(self, directory: Path, refuse: bytes) -> None:
        super().__init__(directory)
        self.refuse = refuse

    def batch_set_from(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        return [k != self.refuse and super(Refusing, self).batch_set_from([k], [s])[0]
                for k, s in zip(keys, spans, strict=True)]


def test_probe_takes_the_longest_run(tmp_path: Path) -> None:
    store, ref = FileStorage(tmp_path), _reference()
    _write(store, 1, ref, HostLayout.PAGE_FIRST_DIRECT)
    _, io = _pool(_shard(0, 2), HostLayout.PAGE_FIRST_DIRECT)
    assert all(io.set_from(store, KEYS[:2], [0, 1]))  # its own objects cover only 2 pages
    probed, source = io.probe(store, KEYS)
    assert probed == PAGES and source.objects == (Piece(HeadRange(0, 4, 4), LayerRange(0, 2, 2)),)


def test_a_rank_shard_and_its_writers() -> None:
    from tierserve.engine.procs.ranks import Ranks
    from tierserve.model.parallel import TensorParallel

    def shard(rank: int, size: int) -> KVShard:
        tp = TensorParallel(rank, size)
        return Ranks(tp, torch.device("cpu")).kv_shard(tp.heads(8, HEADS), HEADS, 2)

    assert shard(1, 2) == KVShard(HeadRange(2, 2, HEADS), 1, True, 2, layers=LayerRange(0, 2, 2))
    assert [(s.heads.start, s.writes) for s in (shard(r, 8) for r in range(8))] == [
        (0, True), (0, False), (1, True), (1, False), (2, True), (2, False), (3, True), (3, False)]


class Recording(FileStorage):
    """A dynamic backend that keeps the config it was built from."""

    def __init__(self, config: dict) -> None:
        super().__init__(config["path"])
        self.config = config


def test_each_rank_gets_its_share_of_the_segment_and_its_faults(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from tierserve.cache.factory import rank_backend
    from tierserve.cache.storage.faulty import FaultyStorage

    config = {"module_path": __name__, "class_name": "Recording", "path": str(tmp_path), "global_segment_size": 1000}
    faults = write_faults(tmp_path / "faults.json", {"ranks": [1], "exists_cap": 2})
    monkeypatch.setenv(FAULTS_ENV, str(faults))  # the tests' channel, never the config
    first, second = KVShard(HeadRange(0, 2, HEADS), 0, True, 2), KVShard(HeadRange(2, 2, HEADS), 1, True, 2)
    with pytest.raises(ValueError, match="'fault_injection' is a test-only switch"):
        rank_backend("dynamic", config | {"fault_injection": {"ranks": [1]}}, second)
    rank0, rank1 = rank_backend("dynamic", config, first), rank_backend("dynamic", config, second)
    assert isinstance(rank0, Recording) and rank0.config["global_segment_size"] == 500
    assert isinstance(rank1, FaultyStorage) and rank1.faults.exists_cap == 2
    _, io = _pool(_shard(0, 1), HostLayout.PAGE_FIRST_DIRECT)
    assert all(io.set_from(rank1, KEYS, list(range(PAGES))))
    assert rank1.batch_exists(KEYS) == 2 and rank0.batch_exists(KEYS) == PAGES


class Counting(FileStorage):
    """Counts the store's calls."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.calls = 0

    def batch_exists(self, keys: list[bytes]) -> int:
        self.calls += 1
        return super().batch_exists(keys)

    def exists_each(self, keys: list[bytes]) -> list[bool]:
        self.calls += 1
        return [self._path(k).exists() for k in keys]


def test_a_fleet_of_one_tp_size_pays_one_extra_probe_call(tmp_path: Path) -> None:
    store, ref = Counting(tmp_path), _reference()
    _write(store, 2, ref, HostLayout.PAGE_FIRST_DIRECT)
    _, io = _pool(_shard(1, 2), HostLayout.PAGE_FIRST_DIRECT)
    store.calls = 0
    assert io.probe(store, KEYS) == (PAGES, io.own) and store.calls == 1  # all there: one call
    longer = KEYS + page_keys(KEYS[-1], [7, 7], 2)  # one page nobody wrote
    store.calls = 0
    assert io.probe(store, longer) == (PAGES, io.own) and store.calls == 2


class _Registering(FileStorage):
    """A file store that checks what a zero-copy store (Mooncake) needs: every span it reads into
    lies in a buffer attached before (else Mooncake registers it inside the read, with a warning)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.attached: list[tuple[int, int]] = []

    def attach_host_buffer(self, buffer: torch.Tensor) -> None:
        storage = buffer.untyped_storage()
        self.attached.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

    def batch_get_into(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        for span in spans:
            assert any(lo <= span.data_ptr() < hi for lo, hi in self.attached), "a span outside attached buffers"
        return super().batch_get_into(keys, spans)


def test_a_reader_of_another_tp_size_attaches_its_staging_buffer_before_reading(tmp_path: Path) -> None:
    store, ref = _Registering(tmp_path), _reference()
    _write(store, 1, ref, HostLayout.PAGE_FIRST_DIRECT)
    host, io = _pool(_shard(0, 2), HostLayout.PAGE_FIRST_DIRECT)
    store.attach_host_buffer(io.buffer)  # what HiCache does with the host pool
    probed, source = io.probe(store, KEYS)
    assert probed == PAGES and not source.direct
    assert all(io.get_into(store, source, KEYS, list(range(PAGES))))
    h = io.shard.heads
    assert torch.equal(host.run_all_layers(0, PAGES), ref[..., h.start : h.end, :])
