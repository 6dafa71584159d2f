"""L3 reads that progress differently per pipeline stage: two real stages (gloo), each with its own
HiCache and L3 client on a real ``mooncake_master``, back a prompt up to L3, drop L1 and L2, and
serve it again from L3 while stage 1's store shows fewer pages and reads slowly, or fails reads
past some page (test faults, stage 1 only). Every stage consumes the same agreed acknowledgement
of how far every stage read (the per-step agreement), so after every step both hold the same tree
(a digest per step), both take the same shorter prefix from L3 and compute the rest, and answer as
without a cache. The negative control (``agreement-off``, run by ``make test``) switches the agreement
off: each stage uses its own reads, and the same checks fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.injected_faults import inject_here
from helpers.processes import MasterProcess
from helpers.rank_agreement import (
    PAGE,
    PROMPT,
    assert_same_tree_every_step,
    collective_timeout_s,
    digest,
    holds_only_with_the_agreement,
    rank_reports,
    report_and_leave,
    run_agreed,
)
from helpers.tiny_models import make_tiny_model

from tierserve.cache.options import HiCacheOptions, PrefetchPolicy
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.procs.ranks import HOST, RankSpec, join

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STAGES = 2
TIMEOUT_S = 20.0  # every collective's
# stage 1's store: shows 6 of the prompt's 17 pages and reads slowly, or fails reads past 5 pages
FAULTS = {"short_and_slow": ({"exists_cap": 6, "get_delay_s": 0.3}, 6), "failing": ({"get_cap": 5}, 5)}
CASES = [*((f, True) for f in sorted(FAULTS)), ("failing", False)]  # (fault, agreed): one negative control


def _config(model: Path, master: str, timeout_s: float) -> EngineConfig:
    l3 = {"master_server_address": master, "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20,
          "prefetch_threshold": 2 * PAGE}
    policy = PrefetchPolicy.WAIT_COMPLETE
    options = HiCacheOptions(storage_backend="mooncake", storage_config=l3, prefetch_policy=policy)
    return EngineConfig(model, device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=512,
                        chunked_prefill_size=16, enable_hierarchical_cache=True, hicache=options, pp_size=STAGES,
                        dist_timeout_s=timeout_s)


def _stage(rank: int, port: int, model: str, master: str, faults: dict, skip: bool, out: str) -> None:
    store = dist.TCPStore(HOST, port, STAGES, is_master=True, wait_for_workers=False) if rank == 0 else None
    inject_here(Path(f"{out}.faults.json"), {"ranks": [1], **faults}, skip)  # before the engine reads them
    timeout_s = collective_timeout_s(TIMEOUT_S, skip)
    config = _config(Path(model), master, timeout_s)
    engine = Engine(config, ranks=join(RankSpec(rank, STAGES, port, timeout_s), config, store))
    digests: list[str] = []
    cold = run_agreed(engine, "cold", PROMPT, digests)  # write-through, then backed up to L3 (steps until done)
    engine.cache.flush(True, True)  # L1 and L2 (every stage at the same point): the next match reads L3
    digests.append(digest(engine))
    l3 = run_agreed(engine, "l3", PROMPT, digests)
    again = run_agreed(engine, "again", PROMPT, digests)  # the tree both stages kept serves it
    report_and_leave(engine, out, {"cold": cold, "l3": l3, "again": again, "digests": digests})


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), heads=8, kv_heads=4, layers=4)



@pytest.mark.parametrize(("fault", "agreed"), CASES, ids=[f"{f}{'' if ok else '-agreement-off'}" for f, ok in CASES])
def test_stages_whose_l3_reads_differ_keep_the_same_tree_every_step(model: Path, master: MasterProcess,
                                                                    tmp_path: Path, fault: str, agreed: bool) -> None:
    faults, agreed_pages = FAULTS[fault]

    def check() -> None:
        first, second = rank_reports(_stage, lambda s, port, out: (s, port, str(model), master.address, faults,
                                                                   not agreed, out), STAGES, tmp_path, 8 * TIMEOUT_S)
        assert_same_tree_every_step(first, second)
        for r in (first, second):
            assert sum(r["cold"][1].values()) == 0, r["cold"]
            assert r["l3"][0] == r["cold"][0] and r["l3"][1]["storage"] == agreed_pages * PAGE, r["l3"]
            assert r["again"][0] == r["cold"][0] and r["again"][1]["device"] >= 16 * PAGE, r["again"]

    holds_only_with_the_agreement(agreed, check)
