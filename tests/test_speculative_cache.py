"""HiCache with draft state: the draft's KV is restored with the target's prefix from L1, L2 and
L3, in the packed and the sidecar layout, checked by its effect on the draft's predictions: for
greedy requests the accepted-draft counts with a cached prefix equal those with no cache, and
corrupting the restored draft rows changes them (while the output stays the target's). For a
draft model (STANDALONE) and an EAGLE head (its rows and the target's hidden states it reads: the
final ones for EAGLE-1, the three captured residual streams, a plane three times as wide, for EAGLE-3)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from helpers.eagle_drafts import recorded_drafts
from helpers.tiny_models import (
    make_eagle_target,
    make_mimic_eagle,
    make_mimic_eagle3,
    make_noisy_draft,
    make_tiny_model,
    widen_kv_heads,
)

from tierserve.cache import hicache as hicache_module
from tierserve.cache.base import PrefixHit
from tierserve.cache.device_pool import KVGeometry
from tierserve.cache.draft_kv import DraftShard, SidecarIO, draft_key
from tierserve.cache.hashing import Namespace
from tierserve.cache.host_pool import HostKVPool, host_page_bytes
from tierserve.cache.loads import HostLoadError
from tierserve.cache.options import DraftLayout, HiCacheOptions, HostLayout, PrefetchPolicy
from tierserve.cache.sharded.cp_host import OwnedShardIO
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.cache.sharded.shard_io import ShardIO
from tierserve.cache.sharded.shards import HeadRange, KVShard
from tierserve.cache.staging import page_io
from tierserve.cache.storage.file import FileStorage
from tierserve.cli.main import build_parser
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig, SpeculativeAlgorithm
from tierserve.engine.engine import Engine
from tierserve.engine.spec.draft_pools import DraftPlan
from tierserve.model.eagle import write_random_eagle
from tierserve.model.parallel import TensorParallel

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
TIERS = ("device", "host", "storage")
_IDS = itertools.count()


@pytest.fixture(scope="module")
def drafts(tiny_llama: Path, tmp_path_factory) -> dict[DraftLayout, Path]:
    """A draft that agrees with the tiny llama about half the time, in each layout: its KV rows
    shaped like the target's (packed) or, the same model with twice the KV heads, not (sidecar)."""
    root = tmp_path_factory.mktemp("drafts")
    wide = widen_kv_heads(make_noisy_draft(tiny_llama, root / "wide", 0.03))
    return {DraftLayout.PACKED: make_noisy_draft(tiny_llama, root / "noisy", 0.03), DraftLayout.SIDECAR: wide}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(21)
    return [torch.randint(2, 384, (40 + 5 * i,), generator=gen).tolist() for i in range(2)]


def _engine(model: Path, draft: Path | None, l3: Path | None = None, cache: bool = True, **spec) -> Engine:
    """``spec``: more speculative settings (EAGLE's algorithm and layout)."""
    storage = {"storage_backend": "file", "storage_config": {"path": str(l3), "prefetch_threshold": 16}} if l3 else {}
    opts = HiCacheOptions(ratio=2.0, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, **storage)
    return Engine(EngineConfig(model, dtype="float32", page_size=4, max_total_tokens=1024, chunked_prefill_size=16,
                               speculative_draft_model_path=draft, enable_hierarchical_cache=cache,
                               disable_radix_cache=not cache, hicache=opts, **spec))


def _run(engine: Engine, prompts: list[list[int]]) -> dict[int, dict]:
    """Each prompt's output ids, accepted draft count and cached tokens by tier, run batched."""
    ids = {f"p{i}-{next(_IDS)}": i for i in range(len(prompts))}
    for rid, i in ids.items():
        engine.add_request(rid, prompts[i], GREEDY)
    out: dict[int, dict] = {i: {"ids": []} for i in ids.values()}
    while engine.has_work():
        for o in engine.step():
            got = out[ids[o.request_id]]
            got |= {"ids": got["ids"] + o.new_token_ids, "accepted": o.spec_accepted_tokens,
                    "tiers": o.cached_by_tier}
    return out


def _draft_rows(engine: Engine) -> list[torch.Tensor]:
    """The device tensors holding the draft's KV: a packed pool's last layers, or the sidecar pool."""
    if engine.draft_pool is not None:
        return [engine.draft_pool.buffer]
    return [engine.pool.buffer[engine.geometry.num_layers :]]


def _scribble(engine: Engine, pages: list[int], layers: slice = slice(None)) -> None:
    """Overwrites the draft's K and V rows of ``pages`` with noise (``layers``: those of the draft's layers)."""
    ps = engine.config.page_size
    slots = torch.tensor([p * ps + j for p in pages for j in range(ps)])
    for rows in _draft_rows(engine):
        rows[layers, :, slots] = torch.randn(rows[layers, :, slots].shape) * 4


@pytest.fixture(scope="module")
def uncached(tiny_llama: Path, drafts: dict[DraftLayout, Path]) -> dict:
    """Per layout, every prompt's output and accepted count on an engine without a prefix cache;
    and the output without speculation."""
    plain = _run(_engine(tiny_llama, None, cache=False), _prompts())
    return {"plain": plain} | {layout: _run(_engine(tiny_llama, d, cache=False), _prompts())
                               for layout, d in drafts.items()}


def _restored(engine: Engine, tier: str, prompts: list[list[int]], corrupt: bool,
              layers: slice = slice(None)) -> dict[int, dict]:
    """Runs ``prompts`` again with their prefix in ``tier``; ``corrupt``: noise over the draft rows
    (of ``layers``) of every restored page once it is in L1, before any draft reads it."""
    engine.cache.wait_background()
    if tier == "host":
        engine.cache.evict(engine.allocator.num_pages)  # only L2 holds the prompts now
        for rows in _draft_rows(engine):
            rows.zero_()  # what L1 still held of them is gone: only the L2 copy can restore it
    if corrupt:
        match = engine.cache.match

        def corrupted(*args, **kwargs) -> PrefixHit:
            hit = match(*args, **kwargs)
            for load in hit.loads:
                load.join()
            _scribble(engine, hit.pages, layers)
            return hit

        engine.cache.match = corrupted
    return _run(engine, prompts)


def _check(got: dict, want: dict, plain: dict, tier: str) -> None:
    for i, w in want.items():
        assert got[i]["tiers"].get(tier, 0) >= 32, got[i]["tiers"]
        assert got[i]["ids"] == w["ids"] == plain[i]["ids"]  # lossless whatever the draft's KV
    assert sum(w["accepted"] for w in want.values()) > 0


@pytest.mark.parametrize("layout", [DraftLayout.PACKED, DraftLayout.SIDECAR])
@pytest.mark.parametrize("tier", ["device", "host"])
def test_restored_draft_kv_gives_the_uncached_acceptance(tiny_llama: Path, drafts: dict, uncached: dict,
                                                         layout: DraftLayout, tier: str) -> None:
    engine = _engine(tiny_llama, drafts[layout])
    assert engine.draft.layout is layout
    first = _run(engine, _prompts())
    assert {i: o["accepted"] for i, o in first.items()} == {i: o["accepted"] for i, o in uncached[layout].items()}
    again = _restored(engine, tier, _prompts(), corrupt=False)
    _check(again, uncached[layout], uncached["plain"], tier)
    assert [again[i]["accepted"] for i in again] == [uncached[layout][i]["accepted"] for i in again]
    assert engine.spec.counters.prompt_catch_up_tokens == 0  # the draft recomputed nothing it was given
    engine.cache.wait_background()
    assert engine.allocator.num_used == engine.cache.num_cached_pages


@pytest.mark.parametrize("layout", [DraftLayout.PACKED, DraftLayout.SIDECAR])
def test_restored_draft_kv_from_l3_gives_the_uncached_acceptance(tiny_llama: Path, drafts: dict, uncached: dict,
                                                                 tmp_path: Path, layout: DraftLayout) -> None:
    """A second engine (zeroed pools) takes the prefixes from the first one's L3 objects: the
    draft's rows come with them (packed: in the same object; sidecar: its own object per page)."""
    first = _engine(tiny_llama, drafts[layout], tmp_path / "l3")
    _run(first, _prompts())
    first.cache.wait_background()
    second = _engine(tiny_llama, drafts[layout], tmp_path / "l3")
    got = _run(second, _prompts())
    _check(got, uncached[layout], uncached["plain"], "storage")
    assert [got[i]["accepted"] for i in got] == [uncached[layout][i]["accepted"] for i in got]
    assert second.spec.counters.prompt_catch_up_tokens == 0


@pytest.mark.parametrize("layout", [DraftLayout.PACKED, DraftLayout.SIDECAR])
@pytest.mark.parametrize("tier", TIERS)
def test_corrupted_draft_kv_changes_acceptance_not_output(tiny_llama: Path, drafts: dict, uncached: dict,
                                                          tmp_path: Path, layout: DraftLayout, tier: str) -> None:
    """The draft really reads the restored rows: noise over them changes the accepted counts
    (verification keeps the output the target's)."""
    engine = _engine(tiny_llama, drafts[layout], tmp_path / "l3")
    _run(engine, _prompts())
    if tier == "storage":
        engine.cache.wait_background()
        engine = _engine(tiny_llama, drafts[layout], tmp_path / "l3")
    got = _restored(engine, tier, _prompts(), corrupt=True)
    _check(got, uncached[layout], uncached["plain"], tier)
    assert [got[i]["accepted"] for i in got] != [uncached[layout][i]["accepted"] for i in got]


def test_namespace_names_the_draft_and_its_layout(tiny_llama: Path, drafts: dict) -> None:
    """Pages cached with a draft's rows never mix with pages of another draft, layout or none."""
    seeds = {_engine(tiny_llama, None).namespace.seed()}
    seeds |= {_engine(tiny_llama, d).namespace.seed() for d in drafts.values()}
    forced = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=4, max_total_tokens=256,
                                 speculative_draft_model_path=drafts[DraftLayout.PACKED],
                                 speculative_draft_layout=DraftLayout.SIDECAR))
    assert forced.draft.layout is DraftLayout.SIDECAR
    seeds.add(forced.namespace.seed())
    assert len(seeds) == 4
    assert Namespace("m", "float32", 4, 2, 2, 16).seed() == Namespace("m", "float32", 4, 2, 2, 16, draft="").seed()


def test_a_failed_draft_copy_fails_the_load_like_a_target_one(tiny_llama: Path, drafts: dict, uncached: dict,
                                                              monkeypatch) -> None:
    """A sidecar's L2 -> L1 copy is part of the load: when it fails, the requests lent the load fail
    alone (as when a target copy fails; a speculating request in the same step goes on unharmed),
    nothing is left allocated, and the next try is right."""
    companion = [(5 * i) % 380 + 2 for i in range(30)]
    want = _run(_engine(tiny_llama, drafts[DraftLayout.SIDECAR], cache=False), [companion])[0]
    engine = _engine(tiny_llama, drafts[DraftLayout.SIDECAR])
    _run(engine, _prompts())
    engine.cache.wait_background()
    engine.cache.evict(engine.allocator.num_pages)
    real = hicache_module.copy_pages

    def failing(device, host, device_ids, host_ids, to_host, backend, layers=None) -> None:
        if device is engine.draft_pool and not to_host:
            raise OSError("injected draft L2 -> L1 failure")
        real(device, host, device_ids, host_ids, to_host, backend, layers)

    monkeypatch.setattr(hicache_module, "copy_pages", failing)
    engine.add_request("companion", companion, GREEDY)
    failures, ids, accepted, added = [], [], 0, False
    while engine.has_work():
        if engine.spec.counters.verify_steps and not added:
            engine.add_request("doomed", _prompts()[0], GREEDY)  # once the companion speculates
            added = True
        for out in engine.step():
            ids, accepted = ids + out.new_token_ids, out.spec_accepted_tokens
        failures += engine.take_failures()
    assert [(rid, type(exc)) for rid, exc in failures] == [("doomed", HostLoadError)]
    assert (ids, accepted) == (want["ids"], want["accepted"])
    engine.cache.wait_background()
    assert engine.allocator.num_used == engine.cache.num_cached_pages
    monkeypatch.undo()
    got = _run(engine, _prompts()[:1])
    assert got[0]["ids"] == uncached["plain"][0]["ids"]
    assert got[0]["accepted"] == uncached[DraftLayout.SIDECAR][0]["accepted"]


def test_serve_refuses_a_packed_layout_the_draft_does_not_fit(tiny_llama: Path, drafts: dict, capsys) -> None:
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama), "--speculative-draft-model-path",
                                      str(drafts[DraftLayout.SIDECAR]), "--speculative-draft-layout", "packed"])
    assert args.func(args) == 2
    assert "packed needs the draft's KV rows shaped like the target's" in capsys.readouterr().err


@pytest.mark.parametrize("layout", [DraftLayout.PACKED, DraftLayout.SIDECAR])
def test_l2_size_counts_the_draft_rows(tiny_llama: Path, drafts: dict, layout: DraftLayout) -> None:
    """``--hicache-size`` bounds L2's bytes, the draft's rows included, in either layout, and the
    room every page-first page keeps for its L3 trailer (the memory the pools really take)."""
    opts = HiCacheOptions(size_gb=2**20 / 2**30)  # 1 MiB
    engine = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=4, max_total_tokens=256,
                                 enable_hierarchical_cache=True, hicache=opts,
                                 speculative_draft_model_path=drafts[layout]))
    sidecar = engine.cache.sidecar
    pools = [engine.cache.host] + ([sidecar.host] if sidecar else [])
    held = sum(p.buffer.untyped_storage().nbytes() for p in pools)
    page = sum(host_page_bytes(p.geometry, p.layout) for p in pools)
    assert 2**20 - page < held <= 2**20


# EAGLE (docs/speculative.md, EAGLE): the head's rows and the target's hidden states (its feature
# plane, the first layers of the draft's rows) come back with the page from every tier, in either
# layout: the head drafts the tokens it drafts uncached; noise over either part once restored changes
# its drafts and the accepted counts. EAGLE-1 and EAGLE-3 (its plane the three captured residual
# streams: three times as wide, more layers) from every tier.


@pytest.fixture(scope="module")
def eagle(tmp_path_factory) -> dict:
    """The one-layer target, an EAGLE-1 head that agrees with it now and then, and the uncached runs."""
    root = tmp_path_factory.mktemp("eagle")
    target = make_eagle_target(root / "target")
    return _eagle_setup(target, make_mimic_eagle(target, root / "head", 0.1))


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory) -> dict:
    """The two-layer target, an EAGLE-3 head reading three of its residual streams (the embedding's
    into its residual too) that agrees with it now and then, and the uncached runs."""
    root = tmp_path_factory.mktemp("eagle3")
    target = make_eagle_target(root / "target", layers=2, embed_rms=0.01)
    return _eagle_setup(target, make_mimic_eagle3(target, root / "head", 0.1, embed_feature=0.3))


def _eagle_setup(target: Path, head: Path) -> dict:
    with recorded_drafts(_prompt_index) as drafts:
        uncached = _run(_engine(target, head, cache=False, **_eagle(DraftLayout.AUTO)), _prompts())
    return {"target": target, "head": head, "uncached": uncached, "drafts": drafts,
            "plain": _run(_engine(target, None, cache=False), _prompts())}


def _eagle(layout: DraftLayout) -> dict:
    return {"speculative_algorithm": SpeculativeAlgorithm.EAGLE, "speculative_draft_layout": layout}


def _prompt_index(rid: str) -> int:
    """The prompt of one of ``_run``'s request ids (``p<i>-<n>``)."""
    return int(rid[1:].split("-")[0])


def _eagle_restored(eagle: dict, layout: DraftLayout, tier: str, l3: Path, part: str | None
                    ) -> tuple[dict[int, dict], dict[int, list[list[int]]]]:
    """The prompts run once, then again with their prefix in ``tier`` (L3: on a second engine):
    the second run's outputs and drafts. ``part``: the draft rows that get noise once restored,
    the head's or the feature plane's (its layers: the drafter's; None: none)."""
    engine = _engine(eagle["target"], eagle["head"], l3, **_eagle(layout))
    assert engine.draft.layout is (DraftLayout.PACKED if layout is DraftLayout.AUTO else layout)
    _run(engine, _prompts())
    if tier == "storage":
        engine.cache.wait_background()
        engine = _engine(eagle["target"], eagle["head"], l3, **_eagle(layout))
    plane = engine.spec.drafter.plane.layers
    layers = {None: slice(None), "head": slice(plane, None), "features": slice(0, plane)}[part]
    with recorded_drafts(_prompt_index) as drafts:
        got = _restored(engine, tier, _prompts(), corrupt=part is not None, layers=layers)
    _check(got, eagle["uncached"], eagle["plain"], tier)
    assert engine.spec.counters.prompt_catch_up_tokens == 0
    return got, drafts


# (head, tier): EAGLE-1 and EAGLE-3 from every tier
HEAD_TIERS = [*(("eagle", t) for t in TIERS), *(("eagle3", t) for t in TIERS)]


@pytest.mark.parametrize("layout", [DraftLayout.AUTO, DraftLayout.SIDECAR])
@pytest.mark.parametrize(("heads", "tier"), HEAD_TIERS)
def test_eagle_restored_rows_give_the_uncached_acceptance(request, tmp_path: Path, layout: DraftLayout, heads: str,
                                                          tier: str) -> None:
    """The restored head rows and features make the head draft what it drafts uncached, step by step."""
    eagle = request.getfixturevalue(heads)
    got, drafts = _eagle_restored(eagle, layout, tier, tmp_path / "l3", None)
    assert [got[i]["accepted"] for i in got] == [eagle["uncached"][i]["accepted"] for i in got]
    assert drafts == eagle["drafts"]


@pytest.mark.parametrize("part", ["head", "features"])
@pytest.mark.parametrize(("heads", "tier"), HEAD_TIERS)
def test_eagle_corrupted_rows_or_features_change_acceptance(request, tmp_path: Path, part: str, heads: str,
                                                            tier: str) -> None:
    """The head reads its restored KV rows and the restored feature of the last cached position
    (EAGLE-3: the plane's layers hold the three captured streams side by side): noise over either
    changes the drafts and the accepted counts."""
    eagle = request.getfixturevalue(heads)
    got, drafts = _eagle_restored(eagle, DraftLayout.SIDECAR, tier, tmp_path / "l3", part)
    assert drafts != eagle["drafts"]
    assert [got[i]["accepted"] for i in got] != [eagle["uncached"][i]["accepted"] for i in got]


def test_sidecar_draft_objects_of_tp_ranks_are_named_by_their_heads(tmp_path: Path) -> None:
    """At TP 2 each rank's sidecar holds its own heads of the draft: both ranks back up a page to
    one store and each reads back its own draft rows (one name for both would hand a rank the other's
    heads); at one rank (every head) the name stays the page's ``draft_key``."""
    storage = FileStorage(tmp_path / "l3")
    ranks = []
    for rank in range(2):
        target = HostKVPool(KVGeometry(2, 1, 16, 4, torch.float32), 2, HostLayout.PAGE_FIRST)
        draft = HostKVPool(KVGeometry(2, 2, 16, 4, torch.float32), 2, HostLayout.PAGE_FIRST)
        shard = KVShard(HeadRange(rank, 1, 2), rank=rank, ranks=2)
        io = SidecarIO(ShardIO(target, page_io(target), shard), draft, storage, DraftShard(HeadRange(2 * rank, 2, 4)))
        draft.buffer.view(2, -1)[0] = rank + 1.0
        assert io.set_from(storage, [b"page"], [0]) == [True]
        ranks.append((io, draft))
    for rank, (io, draft) in enumerate(ranks):
        assert io.get_into(storage, io.own, [b"page"], [1]) == [True]
        assert torch.all(draft.buffer.view(2, -1)[1] == rank + 1.0)
    assert draft_key(b"page", HeadRange(0, 4, 4)) == draft_key(b"page")


def test_sidecar_draft_objects_are_read_across_tp_sizes(tmp_path: Path) -> None:
    """A node of one rank finds and reads the draft rows two tensor ranks backed up (each its heads'
    object), and each of two ranks its heads of the rows one rank backed up whole, as the target's
    shares are read. Before, another TP size's draft objects were never found: the page counted as
    absent, so a re-prefill between TP sizes (a migration) computed its prompt again."""
    storage = FileStorage(tmp_path / "l3")
    for rank in range(2):
        io, draft = _tp_sidecar_io(rank, 2, storage)
        _set_heads(draft, 0, [1.0 + 2 * rank + h for h in range(2)])
        assert io.set_from(storage, [b"a"], [0]) == [True]
    whole, draft = _tp_sidecar_io(0, 1, storage)
    found, source = whole.probe(storage, [b"a", b"b"])
    assert found == 1 and whole.get_into(storage, source, [b"a"], [1]) == [True]
    assert _heads(draft, 1) == [1.0, 2.0, 3.0, 4.0]
    _set_heads(draft, 0, [10.0, 11.0, 12.0, 13.0])
    assert whole.set_from(storage, [b"b"], [0]) == [True]
    for rank in range(2):
        io, draft = _tp_sidecar_io(rank, 2, storage)
        found, source = io.probe(storage, [b"b"])
        assert found == 1 and io.get_into(storage, source, [b"b"], [1]) == [True]
        assert _heads(draft, 1) == [10.0 + 2 * rank, 11.0 + 2 * rank]


def _tp_sidecar_io(rank: int, tp: int, storage: FileStorage) -> tuple[SidecarIO, HostKVPool]:
    """Tensor rank ``rank`` of ``tp``: its L3 side over its share of 2 target and 4 draft KV heads."""
    target = HostKVPool(KVGeometry(2, 2 // tp, 16, 4, torch.float32), 2, HostLayout.PAGE_FIRST)
    draft = HostKVPool(KVGeometry(2, 4 // tp, 16, 4, torch.float32), 2, HostLayout.PAGE_FIRST)
    shard = KVShard(HeadRange(rank * 2 // tp, 2 // tp, 2), rank=rank, ranks=tp)
    heads = DraftShard(HeadRange(rank * 4 // tp, 4 // tp, 4))
    return SidecarIO(ShardIO(target, page_io(target), shard), draft, storage, heads), draft


def _set_heads(pool: HostKVPool, page: int, values: list[float]) -> None:
    for h, value in enumerate(values):
        pool.run_all_layers(page, 1)[..., h, :] = value


def _heads(pool: HostKVPool, page: int) -> list[float]:
    """Each head's value on host page ``page`` (every element of a head is that value)."""
    rows = pool.run_all_layers(page, 1)
    return [float(rows[..., h, :].unique().item()) for h in range(rows.shape[-2])]


def test_sidecar_draft_objects_of_cp_ranks_are_written_and_read_by_their_owners(tmp_path: Path) -> None:
    """At CP 2 a rank's host pools hold the pages it owns at local slots (host ids are logical): each
    rank backs up the draft objects of its own pages, from their local slots, and reads them back
    into them; another rank's page counts as read (its owner reports on it). Before, the draft part
    wrote and read every page at its logical id, beside a target part that reported its own only."""
    storage, keys = FileStorage(tmp_path / "l3"), [bytes([i]) * 32 for i in range(4)]
    for rank in (0, 1):
        io, draft = _cp_sidecar_io(rank, storage)
        draft.buffer.view(2, -1)[0], draft.buffer.view(2, -1)[1] = 10.0 * rank + 1, 10.0 * rank + 2
        assert io.set_from(storage, keys, [0, 1, 2, 3]) == [True, True]  # its own two pages
    assert storage.batch_exists([draft_key(k) for k in keys]) == 4  # each page's rows, written by its owner
    for rank in (0, 1):
        io, draft = _cp_sidecar_io(rank, storage)
        assert io.get_into(storage, io.own, keys, [2, 3, 0, 1]) == [True] * 4
        assert draft.buffer.view(2, -1)[:, 0].tolist() == [10.0 * rank + 2, 10.0 * rank + 1]  # pages 2, 0 or 3, 1


def _cp_sidecar_io(rank: int, storage: FileStorage) -> tuple[SidecarIO, HostKVPool]:
    own = PageOwnership(rank, 2)
    target = HostKVPool(KVGeometry(2, 1, 16, 4, torch.float32), 2, HostLayout.PAGE_FIRST, ownership=own)
    draft = HostKVPool(KVGeometry(2, 2, 16, 4, torch.float32), 2, HostLayout.PAGE_FIRST)
    io = SidecarIO(OwnedShardIO(target, page_io(target), KVShard.whole(1), own), draft, storage, ownership=own)
    return io, draft


@pytest.mark.parametrize(("algorithm", "writers"), [(SpeculativeAlgorithm.STANDALONE, [True, False, True, False]),
                                                    (SpeculativeAlgorithm.EAGLE, [True, False, False, False])])
def test_tp_ranks_holding_the_same_draft_rows_write_them_once(tmp_path: Path, algorithm, writers: list[bool]) -> None:
    """At TP 4 a draft of 2 KV heads puts each on two ranks, of which the first writes its L3 objects,
    as the target's replicas do; an EAGLE head is whole on every rank, rank 0 writes it."""
    target = make_tiny_model("llama", tmp_path / "target", heads=8, kv_heads=4)
    draft = write_random_eagle(target, tmp_path / "head") if algorithm is SpeculativeAlgorithm.EAGLE else \
        make_tiny_model("llama", tmp_path / "draft", heads=4, kv_heads=2)
    config = EngineConfig(target, speculative_draft_model_path=draft, speculative_algorithm=algorithm)
    geometry = KVGeometry(2, 1, 16, 4, torch.float32)
    plans = [DraftPlan.of(config, geometry, 512, 4, TensorParallel(rank, 4)) for rank in range(4)]
    assert [p.writes for p in plans] == writers
    assert all(p.layout is DraftLayout.SIDECAR for p in plans)
