"""A prefetch whose L3 read never returns (docs/cache.md, stuck reads; issue 31): past
``prefetch_timeout_max`` it is abandoned, the request computes the pages instead and answers as
without a cache, its host pages leave the prefetch reservations for a quarantine that the metrics
show, and once the stuck call returns they are freed (no leak). The read is held by the test-only
``hold_reads_until`` fault (``StorageFaults``) through the tests' fault file."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers.engine_runs import run_one
from helpers.injected_faults import write_faults

from tierserve.cache.options import HiCacheOptions, PrefetchPolicy, WritePolicy
from tierserve.core.sampling import SamplingParams
from tierserve.core.test_hooks import FAULTS_ENV
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

PAGE, MAX_NEW = 4, 6
PROMPT = torch.randint(2, 384, (70,), generator=torch.Generator().manual_seed(7)).tolist()  # 17 full pages
TIMEOUT_MAX_S = 1.0  # the bound: a prefetch read still running after this is abandoned
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _engine(model: Path, l3: Path) -> Engine:
    """``wait_complete``: the request would wait for the read for ever, were it not for the bound."""
    l3_config = {"path": str(l3), "prefetch_threshold": 2 * PAGE, "prefetch_timeout_base": TIMEOUT_MAX_S,
                 "prefetch_timeout_max": TIMEOUT_MAX_S}
    hicache = HiCacheOptions(storage_backend="file", storage_config=l3_config, write_policy=WritePolicy.WRITE_THROUGH,
                             prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    return Engine(EngineConfig(model, device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=512,
                               enable_hierarchical_cache=True, hicache=hicache))


def _run_until_finished(engine: Engine, deadline_s: float) -> tuple[list[int], dict[str, int]]:
    """Steps until the one request ends (not until the engine is idle: the stuck read keeps it busy)."""
    engine.add_request("stuck", PROMPT, GREEDY)
    tokens: list[int] = []
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for out in engine.step():
            tokens += out.new_token_ids
            if out.finished:
                return tokens, out.cached_by_tier
    raise AssertionError(f"the request did not end within {deadline_s} s")


def _l3(engine: Engine) -> dict[str, float]:
    return engine.cache.stats()


def _host_pages_of_tree(engine: Engine) -> int:
    return sum(len(n.host) for n in engine.cache.tree.nodes() if n.host is not None)


def test_a_stuck_prefetch_is_abandoned_its_pages_quarantined_then_freed(tiny_llama: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    writer = _engine(tiny_llama, tmp_path / "l3")
    cold, _ = run_one(writer, PROMPT, GREEDY)
    writer.cache.wait_background()  # every page in L3
    writer.cache.close()
    release = tmp_path / "release"
    monkeypatch.setenv(FAULTS_ENV, str(write_faults(tmp_path / "faults.json",
                                                    {"ranks": [0], "hold_reads_until": str(release)})))
    reader = _engine(tiny_llama, tmp_path / "l3")  # its store's reads never return until ``release`` exists
    try:
        started = time.monotonic()
        warm, tiers = _run_until_finished(reader, 30)
        took = time.monotonic() - started
        assert warm == cold and tiers.get("storage", 0) == 0, tiers  # computed, as without a cache
        assert TIMEOUT_MAX_S <= took < TIMEOUT_MAX_S + 5, took  # waited for L3 up to the bound, not longer
        held = _l3(reader)
        assert held["l3_prefetch_abandoned_total"] == 1
        assert held["l3_prefetch_reserved_pages"] == 0  # out of the prefetch reservations ...
        quarantined = held["l3_prefetch_quarantined_pages"]
        assert quarantined == len(PROMPT) // PAGE  # ... but not free: the stuck read may still land there
        assert held["host_pages_used"] >= _host_pages_of_tree(reader) + quarantined  # L2 writes may be in flight
        assert reader.has_work()  # the ticket waits for its reader (the loop backs off meanwhile)
        release.touch()  # the stuck call returns
        deadline = time.monotonic() + 20
        while reader.has_work() and time.monotonic() < deadline:
            reader.step()
        freed = _l3(reader)
        assert not reader.has_work() and freed["l3_prefetch_quarantined_pages"] == 0
        assert freed["host_pages_used"] == _host_pages_of_tree(reader)  # every quarantined page freed
        assert freed["l3_prefetch_abandoned_total"] == 1
    finally:
        release.touch()
        reader.cache.close()
