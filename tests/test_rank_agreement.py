"""Two real ranks (gloo, real ``mooncake_master``; TP 2, and CP 2 for failing reads) whose L3 views
differ: rank 1's store shows fewer pages, its reads fail past a count, or they lag past the prefetch
timeout. With the per-step
agreement both ranks take only the shorter prefix from L3, end with the same tree and answer as
without a cache. The negative controls (``agreement-off``, run by ``make test``; a case with one fault
of each kind) switch the agreement off: each rank applies its own view, the ranks diverge, and the same
checks fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.injected_faults import inject_here
from helpers.processes import MasterProcess
from helpers.rank_agreement import (
    PAGE,
    PROMPT,
    collective_timeout_s,
    holds_only_with_the_agreement,
    rank_reports,
    report_and_leave,
    run_agreed,
    tree_of,
)
from helpers.tiny_models import make_tiny_model

from tierserve.cache import hicache
from tierserve.cache.options import HiCacheOptions, PrefetchPolicy
from tierserve.cache.sharded.agreement import SingleRank
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.procs.ranks import HOST, RankSpec, join, leave

pytestmark = [pytest.mark.integration, pytest.mark.slow]
COPY_PAGES = hicache.copy_pages

SHOWN_PAGES = 6  # what rank 1's faulty store admits to, or reads
TIMEOUT_S = 30.0  # every collective's, and the deadline of each rank's loop
LAG_S = 5.0  # rank 1's delay before each read call: far past the prefetch timeout below
# fault -> (rank 1's fault, prefetch policy, pages every rank must take from L3)
FAULTS = {"exists": ({"ranks": [1], "exists_cap": SHOWN_PAGES}, PrefetchPolicy.WAIT_COMPLETE, SHOWN_PAGES),
          "reads": ({"ranks": [1], "get_cap": SHOWN_PAGES}, PrefetchPolicy.WAIT_COMPLETE, SHOWN_PAGES),
          "lags": ({"ranks": [1], "get_delay_s": LAG_S}, PrefetchPolicy.TIMEOUT, 0)}
LAYOUTS = {"tp2": {"tp_size": 2}, "cp2": {"cp_size": 2}}  # -> EngineConfig sizes
# (layout, fault, agreed): every fault at TP 2; CP 2's reads failing (lagging reads take the TP path: the
# prefetch timeout); a negative control of each layout (CP's waits out a collective timeout)
CASES = [*(("tp2", f, True) for f in sorted(FAULTS)), ("tp2", "exists", False),
         ("cp2", "reads", True), ("cp2", "exists", False)]


def _config(model: Path, master: str, layout: str, policy: PrefetchPolicy = PrefetchPolicy.WAIT_COMPLETE,
            timeout_s: float = TIMEOUT_S) -> EngineConfig:
    l3 = {"master_server_address": master, "global_segment_size": 32 << 20, "local_buffer_size": 8 << 20,
          "prefetch_threshold": 2 * PAGE, "prefetch_timeout_base": 0.5, "prefetch_timeout_per_ki_token": 0.0}
    hicache = HiCacheOptions(storage_backend="mooncake", storage_config=l3, prefetch_policy=policy)
    return EngineConfig(model, device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=512,
                        chunked_prefill_size=16, enable_hierarchical_cache=True, hicache=hicache,
                        dist_timeout_s=timeout_s, **LAYOUTS[layout])


def _from_l3(layout: str, fault: str) -> int:
    """The prompt's pages every rank must take from L3. Rank 1's fault caps the pages it holds: all of them
    at TP, every other page of the prompt at CP (pages rotate over the owners, docs/cp.md), so its
    ``SHOWN_PAGES`` pages end a prefix of ``2 * SHOWN_PAGES + 1`` there (the page after is rank 0's)."""
    shown = FAULTS[fault][2]
    return 2 * shown + 1 if layout == "cp2" and shown else shown


def _rank(rank: int, port: int, model: str, master: str, layout: str, fault: str, skip: bool, out: str) -> None:
    store = dist.TCPStore(HOST, port, 2, is_master=True, wait_for_workers=False) if rank == 0 else None
    timeout_s = collective_timeout_s(TIMEOUT_S, skip)
    config = _config(Path(model), master, layout, timeout_s=timeout_s)
    ranks = join(RankSpec(rank, 2, port, timeout_s), config, store)
    writer = Engine(config, ranks=ranks)  # its segment holds the pages
    cold, _ = run_agreed(writer, "cold", PROMPT, count_failures=True)
    faults, policy, _ = FAULTS[fault]
    inject_here(Path(f"{out}.faults.json"), faults, skip)  # the reader's alone: built after this
    reader = Engine(_config(Path(model), master, layout, policy, timeout_s), ranks=ranks)
    warm, tiers = run_agreed(reader, "warm", PROMPT, count_failures=True)
    tree = tree_of(reader)
    flushed = reader.cache.flush(True, True)  # every rank at the same point, as the step bus makes them
    Path(out).write_text(json.dumps({"cold": cold, "warm": warm, "tiers": tiers, "tree": tree, "flushed": flushed,
                                     "left": tree_of(reader)}))
    ranks.agree_min(0)  # neither leaves (and drops its store segment) before the other is done
    for engine in (reader, writer):
        engine.cache.close()
    leave()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), heads=8, kv_heads=4)


@pytest.mark.parametrize(("layout", "fault", "agreed"), CASES, ids=[f"{lay}-{f}{'' if ok else '-agreement-off'}"
                                                                   for lay, f, ok in CASES])
def test_a_rank_with_a_shorter_l3_view_shortens_every_rank(model: Path, tmp_path: Path, layout: str, fault: str,
                                                           agreed: bool) -> None:
    def check() -> None:
        master = MasterProcess(tmp_path / "master.log").start()
        try:
            results = rank_reports(_rank, lambda r, port, out: (r, port, str(model), master.address, layout,
                                                                fault, not agreed, out), 2, tmp_path, 4 * TIMEOUT_S)
        finally:
            master.kill()
        assert results[0]["tree"] == results[1]["tree"]
        assert results[0]["flushed"] == results[1]["flushed"] and results[0]["left"] == results[1]["left"] == []
        assert results[0]["warm"] == results[0]["cold"] == results[1]["warm"]
        assert results[0]["tiers"].get("storage", 0) == _from_l3(layout, fault) * PAGE, results[0]["tiers"]

    holds_only_with_the_agreement(agreed, check)


def _failing_loads(*args: object) -> None:
    if args[4] is False:  # copy_pages(device, host, device pages, host pages, to_host, ...): an L2 -> L1 load
        raise RuntimeError("injected L2 -> L1 copy failure")
    return COPY_PAGES(*args)


def _load_rank(rank: int, port: int, model: str, skip: bool, out: str) -> None:
    store = dist.TCPStore(HOST, port, 2, is_master=True, wait_for_workers=False) if rank == 0 else None
    config = EngineConfig(Path(model), device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=512,
                          chunked_prefill_size=16, enable_hierarchical_cache=True, tp_size=2, dist_timeout_s=TIMEOUT_S)
    engine = Engine(config, ranks=join(RankSpec(rank, 2, port, TIMEOUT_S), config, store))
    if skip:  # each rank judges its own restores: the failing rank fails alone, after the forward
        engine.restore_agreement = SingleRank()
    cold, _ = run_agreed(engine, "cold", PROMPT, count_failures=True)  # write-through: its pages reach L2
    engine.cache.flush(True, False)  # L2 only: the next match loads them into L1
    if rank == 1:
        hicache.copy_pages = _failing_loads
    failed = run_agreed(engine, "failed", PROMPT, count_failures=True)
    hicache.copy_pages = COPY_PAGES
    trees = [tree_of(engine)]
    warm = run_agreed(engine, "warm", PROMPT, count_failures=True)
    report_and_leave(engine, out, {"cold": cold, "failed": failed, "warm": warm, "trees": [*trees, tree_of(engine)]})


@pytest.mark.parametrize("agreed", [True, False], ids=["agreed", "agreement-off"])
def test_an_l2_load_failing_on_one_rank_fails_the_request_on_every_rank(model: Path, tmp_path: Path,
                                                                       agreed: bool) -> None:
    def check() -> None:
        results = rank_reports(_load_rank, lambda r, port, out: (r, port, str(model), not agreed, out), 2, tmp_path,
                               4 * TIMEOUT_S)
        assert results[0]["trees"] == results[1]["trees"]
        for r in results:
            assert r["failed"] == [[], {"failed": 1}]
            assert r["warm"][0] == r["cold"] == results[0]["cold"] and r["warm"][1].get("host", 0) > 0, r["warm"]

    holds_only_with_the_agreement(agreed, check)
