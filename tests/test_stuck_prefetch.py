"""A prefetch whose L3 read never returns (docs/cache.md, stuck reads; issue 31): past
``prefetch_timeout_max`` it is abandoned, the request computes the pages instead and answers as
without a cache, its host pages leave the prefetch reservations for a quarantine that the metrics
show, and once the stuck call returns they are freed (no leak); at one rank and at two, where one
rank's read is stuck and the other's lands. The read is held by the test-only
``hold_reads_until`` fault (``StorageFaults``) through the tests' fault file."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.engine_runs import run_one
from helpers.injected_faults import inject_here, write_faults
from helpers.rank_agreement import rank_reports, report_and_leave, run_agreed

from tierserve.cache.options import HiCacheOptions, PrefetchPolicy, WritePolicy
from tierserve.core.sampling import SamplingParams
from tierserve.core.test_hooks import FAULTS_ENV
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.procs.ranks import HOST, RankSpec, join

PAGE, MAX_NEW = 4, 8  # 8: as run_agreed asks at two ranks
PROMPT = torch.randint(2, 384, (70,), generator=torch.Generator().manual_seed(7)).tolist()  # 17 full pages
TIMEOUT_MAX_S = 1.0  # the bound: a prefetch read still running after this is abandoned
TIMEOUT_S = 30.0  # every collective's at two ranks
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _config(model: Path, l3: Path, tp: int = 1) -> EngineConfig:
    """``wait_complete``: the request would wait for the read for ever, were it not for the bound."""
    l3_config = {"path": str(l3), "prefetch_threshold": 2 * PAGE, "prefetch_timeout_base": TIMEOUT_MAX_S,
                 "prefetch_timeout_max": TIMEOUT_MAX_S}
    hicache = HiCacheOptions(storage_backend="file", storage_config=l3_config, write_policy=WritePolicy.WRITE_THROUGH,
                             prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    return EngineConfig(model, device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=512,
                        enable_hierarchical_cache=True, hicache=hicache, tp_size=tp, dist_timeout_s=TIMEOUT_S)


def _step_until_finished(engine: Engine, deadline_s: float) -> tuple[list[int], dict[str, int]]:
    """Steps until the one request ends (not until the engine is idle: the stuck read keeps it busy);
    at several ranks every rank steps until all saw it end (one collective per turn)."""
    engine.add_request("stuck", PROMPT, GREEDY)
    tokens: list[int] = []
    tiers: dict[str, int] = {}
    finished = False
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for out in engine.step():
            tokens += out.new_token_ids
            tiers, finished = out.cached_by_tier or tiers, finished or out.finished
        if engine.ranks.agree_min(int(finished)) == 1:
            return tokens, tiers
    raise AssertionError(f"the request did not end within {deadline_s} s")


def _step_while_busy(engine: Engine, deadline_s: float) -> None:
    """Steps while any rank has work (the stuck ticket until every reader returned)."""
    deadline = time.monotonic() + deadline_s
    while engine.ranks.agree_min(-int(engine.has_work())) < 0 and time.monotonic() < deadline:
        engine.step()


def _prefetch_state(engine: Engine) -> dict[str, float]:
    """The L3 metrics this test reads, and the host pages used beyond those the tree holds."""
    stats = engine.cache.stats()
    keys = ("l3_prefetch_abandoned_total", "l3_prefetch_reserved_pages", "l3_prefetch_quarantined_pages")
    tree = sum(len(n.host) for n in engine.cache.tree.nodes() if n.host is not None)
    return {k: stats[k] for k in keys} | {"untracked_host_pages": stats["host_pages_used"] - tree,
                                          "busy": float(engine.has_work())}


def _stuck_then_released(reader: Engine, release: Path) -> dict:
    """The stuck request's run (tokens, tiers, seconds) and the prefetch state while the read is held
    and after it was released (by rank 0 at several ranks: the ranks meet before and after)."""
    started = time.monotonic()
    warm, tiers = _step_until_finished(reader, 30)
    took = time.monotonic() - started
    held = _prefetch_state(reader)
    reader.ranks.agree_min(0)
    if reader.ranks.rank == 0:
        release.touch()  # the stuck call returns
    reader.ranks.agree_min(0)
    _step_while_busy(reader, 20)
    return {"warm": warm, "tiers": tiers, "took": took, "held": held, "freed": _prefetch_state(reader)}


def _check(report: dict, cold: list[int]) -> None:
    assert report["warm"] == cold and report["tiers"].get("storage", 0) == 0, report  # computed, as without a cache
    assert TIMEOUT_MAX_S <= report["took"] < TIMEOUT_MAX_S + 5, report  # waited for L3 up to the bound only
    held, freed = report["held"], report["freed"]
    assert held["l3_prefetch_abandoned_total"] == 1 and held["busy"]  # the ticket waits for its reader
    assert held["l3_prefetch_reserved_pages"] == 0  # out of the prefetch reservations ...
    quarantined = held["l3_prefetch_quarantined_pages"]
    assert quarantined == len(PROMPT) // PAGE  # ... but not free: the stuck read may still land there
    assert held["untracked_host_pages"] >= quarantined  # (L2 writes of the request may be in flight too)
    assert freed == {"l3_prefetch_abandoned_total": 1, "l3_prefetch_reserved_pages": 0,
                     "l3_prefetch_quarantined_pages": 0, "untracked_host_pages": 0, "busy": 0.0}  # no leak


def test_a_stuck_prefetch_is_abandoned_its_pages_quarantined_then_freed(tiny_llama: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    writer = Engine(_config(tiny_llama, tmp_path / "l3"))
    cold, _ = run_one(writer, PROMPT, GREEDY)
    writer.cache.wait_background()  # every page in L3
    writer.cache.close()
    release = tmp_path / "release"
    monkeypatch.setenv(FAULTS_ENV, str(write_faults(tmp_path / "faults.json",
                                                    {"ranks": [0], "hold_reads_until": str(release)})))
    reader = Engine(_config(tiny_llama, tmp_path / "l3"))  # its store's reads never return until ``release`` exists
    try:
        _check(_stuck_then_released(reader, release), cold)
    finally:
        release.touch()
        reader.cache.close()


def _tp_rank(rank: int, port: int, model: str, folder: str, out: str) -> None:
    """Rank ``rank`` of two: writes the prompt to L3, then reads it back with rank 1's reads held."""
    store = dist.TCPStore(HOST, port, 2, is_master=True, wait_for_workers=False) if rank == 0 else None
    config = _config(Path(model), Path(folder) / "l3", tp=2)
    ranks = join(RankSpec(rank, 2, port, TIMEOUT_S), config, store)
    writer = Engine(config, ranks=ranks)
    cold, _ = run_agreed(writer, "cold", PROMPT)
    release = Path(folder) / "release"
    inject_here(Path(f"{out}.faults.json"), {"ranks": [1], "hold_reads_until": str(release)})
    reader = Engine(config, ranks=ranks)  # built after the fault file: rank 1's reads are held
    try:
        report = _stuck_then_released(reader, release)
    finally:
        release.touch()
    writer.cache.close()
    report_and_leave(reader, out, {"cold": cold, **report})


@pytest.mark.integration
@pytest.mark.slow
def test_at_two_ranks_one_ranks_stuck_read_is_abandoned_on_both(ranks_llama: Path, tmp_path: Path) -> None:
    """Rank 1's reads are held, rank 0's land: the abandonment is agreed, so both ranks compute,
    quarantine the same pages and free them at the same step once rank 1's call returns."""
    reports = rank_reports(_tp_rank, lambda r, port, out: (r, port, str(ranks_llama), str(tmp_path), out), 2, tmp_path,
                           4 * TIMEOUT_S)
    for report in reports:
        _check(report, reports[0]["cold"])
