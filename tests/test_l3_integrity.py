"""End-to-end integrity of L3 objects on a real ``mooncake_master`` (``cache/storage/integrity.py``):
1,000 injected corruptions (bit flips, truncations, objects swapped between keys, objects written
in another layout) are each a miss, counted, and removed; an engine reading corrupted objects
recomputes them and answers exactly what an engine without a cache answers."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.engine_runs import run_one
from helpers.mooncake_engines import PARAMS, l3_engine, prompt_of, settle

from tierserve.cache.device_pool import KVGeometry
from tierserve.cache.host_pool import HostKVPool, HostLayout
from tierserve.cache.storage import create_backend
from tierserve.cache.storage.mooncake import MooncakeStorage

pytestmark = pytest.mark.integration
PAGES = 250  # per round; four rounds, one kind of corruption each


def _stores(master, closing) -> tuple[MooncakeStorage, MooncakeStorage]:
    """The checked backend, and a raw client of the same store that writes objects as they are."""
    config = {"master_server_address": master.address, "global_segment_size": 32 << 20, "local_buffer_size": 16 << 20}
    return closing(create_backend("mooncake", config)), closing(create_backend("mooncake", config | {"integrity": 0}))


def _rewrite(raw: MooncakeStorage, name: str, data: bytes) -> None:
    """Replaces an object (a put of an existing name would keep the old one)."""
    store = raw._store
    assert store.remove(name, True) == 0  # forced: a read leaves a lease on the object
    assert store.put(name, data) == 0


def _flip(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    bit = rng.randrange(len(out) * 8)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def _corrupt(kind: str, raw: MooncakeStorage, names: list[str], pages: torch.Tensor, rng: random.Random) -> None:
    objects = [raw._store.get(n) for n in names]
    for i, name in enumerate(names):
        if kind == "flip":  # anywhere: in the page or in its trailer
            _rewrite(raw, name, _flip(rng, objects[i]))
        elif kind == "truncate":
            _rewrite(raw, name, objects[i][: rng.randrange(1, len(objects[i]))])
        elif kind == "swap":  # another key's intact object, trailer and all
            _rewrite(raw, name, objects[i ^ 1])
        else:  # written by another layout: the page's bytes in another order, as a writer without trailers stores them
            _rewrite(raw, name, pages[i].reshape(16, -1).t().contiguous().numpy().tobytes())


def _pools(room: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """1 KiB pages to write and to read into: host pools whose pages have room for their trailer
    (each object one buffer), or plain tensors (page and trailer two buffers)."""
    if not room:
        return torch.randn(PAGES, 256), torch.zeros(PAGES, 256)
    pages, into = (HostKVPool(KVGeometry(1, 1, 64, 2, torch.float32), PAGES, HostLayout.PAGE_FIRST_DIRECT).buffer
                   for _ in range(2))
    pages.copy_(torch.randn(pages.shape))
    return pages, into


@pytest.mark.parametrize("room", [True, False], ids=["one-buffer", "two-buffers"])
def test_a_thousand_corrupted_objects_are_each_a_counted_miss(mooncake_master, closing, room: bool) -> None:
    store, raw = _stores(mooncake_master, closing)
    pages, into = _pools(room)
    for pool in (pages, into):
        store.attach_host_buffer(pool)
    assert store._room.covers(*store._locate(list(into))) is room  # the way under test
    keys = [i.to_bytes(32, "little") for i in range(PAGES)]
    names = store._names(keys)
    rng = random.Random(18)
    for round_, kind in enumerate(("flip", "truncate", "swap", "layout")):
        assert store.batch_set_from(keys, list(pages)) == [True] * PAGES
        assert store.batch_get_into(keys, list(into)) == [True] * PAGES and torch.equal(into, pages)
        _corrupt(kind, raw, names, pages, rng)
        assert store.batch_get_into(keys, list(into)) == [False] * PAGES, kind  # not one accepted
        assert store.stats()["integrity_failures"] == PAGES * (round_ + 1), kind
        assert store.exists_each(keys) == [False] * PAGES  # removed: the next backup stores them again
    assert store.stats()["integrity_failures"] == 1000


def test_an_engine_recomputes_corrupted_pages_and_answers_as_without_a_cache(
        long_llama, plain: Callable[[list[int]], list[int]], mooncake_master, closing) -> None:
    prompt = prompt_of(18, 400)
    first = l3_engine(long_llama, mooncake_master, closing)
    written: list[str] = []
    backend = first.cache.storage.storage
    set_from = backend.batch_set_from
    backend.batch_set_from = lambda keys, spans: written.extend(backend._names(keys)) or set_from(keys, spans)
    assert run_one(first, prompt, PARAMS)[0] == plain(prompt)
    settle(first)
    _, raw = _stores(mooncake_master, closing)
    rng = random.Random(7)
    for i, name in enumerate(written):  # every object of the prompt: each a different corruption
        data = raw._store.get(name)
        kind = i % 3
        _rewrite(raw, name, _flip(rng, data) if kind == 0 else data[: len(data) // 2] if kind == 1
                 else raw._store.get(written[i - 1]))
    second = l3_engine(long_llama, mooncake_master, closing)  # empty L1 and L2: it can only read L3
    tokens, tiers = run_one(second, prompt, PARAMS)
    assert tokens == plain(prompt)
    failures = second.cache.storage.storage.stats()["integrity_failures"]
    assert failures >= 1 and tiers.get("storage", 0) == 0, (failures, tiers)
    assert second.cache.stats()["l3_integrity_failures_total"] == failures  # /metrics: tierserve_cache_l3_...


FILE_PAGES = 50  # per round in the file backend: 200 corruptions


def _corrupt_file(kind: str, path: Path, other: bytes, page: torch.Tensor, rng: random.Random) -> None:
    data = path.read_bytes()
    if kind == "flip":
        path.write_bytes(_flip(rng, data))
    elif kind == "truncate":
        path.write_bytes(data[: rng.randrange(1, len(data))])
    elif kind == "swap":  # another key's intact file, trailer and all
        path.write_bytes(other)
    else:  # written without trailers, in another layout
        path.write_bytes(page.reshape(16, -1).t().contiguous().numpy().tobytes())


def test_the_file_backend_counts_each_corrupted_file_as_a_miss(tmp_path: Path) -> None:
    store = create_backend("file", {"path": str(tmp_path)})
    pages, into = torch.randn(FILE_PAGES, 256), torch.zeros(FILE_PAGES, 256)
    keys = [i.to_bytes(32, "little") for i in range(FILE_PAGES)]
    rng = random.Random(18)
    for round_, kind in enumerate(("flip", "truncate", "swap", "layout")):
        assert store.batch_set_from(keys, list(pages)) == [True] * FILE_PAGES
        assert store.batch_get_into(keys, list(into)) == [True] * FILE_PAGES and torch.equal(into, pages)
        paths = [tmp_path / f"{k.hex()}.kv" for k in keys]
        files = [p.read_bytes() for p in paths]
        for i, path in enumerate(paths):
            _corrupt_file(kind, path, files[i ^ 1], pages[i], rng)
        assert store.batch_get_into(keys, list(into)) == [False] * FILE_PAGES, kind  # not one accepted
        assert store.stats()["integrity_failures"] == FILE_PAGES * (round_ + 1), kind
        assert store.exists_each(keys) == [False] * FILE_PAGES  # deleted: the next backup writes them again
    assert store.set(b"k", b"bytes") and store.get(b"k") == b"bytes"
    (tmp_path / f"{b'k'.hex()}.kv").write_bytes(b"bytes")  # no trailer
    assert store.get(b"k") is None and store.stats()["integrity_failures"] == 4 * FILE_PAGES + 1
