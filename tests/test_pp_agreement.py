"""pp_sync: two real pipeline stages (gloo), each with its own HiCache over its own layers, whose
L1 -> L2 writes and L2 -> L1 loads finish at different times (injected per stage: stage 0's loads
lag, stage 1's writes lag). Every stage applies cache changes in the same order, so after every
step both hold the same tree (a digest per step: tokens, page ids, write and load states), and
answers from L1 and L2 equal the cold answer. With the agreement switched off
(``TIERSERVE_TEST_SKIP_AGREEMENT=1``, to prove the test can fail) each stage applies its own
finished transfers, the trees differ at some step, and this test fails."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.injected_faults import inject_here
from helpers.rank_agreement import (
    PAGE,
    PROMPT,
    assert_same_tree_every_step,
    digest,
    rank_reports,
    report_and_leave,
    run_agreed,
)
from helpers.tiny_models import make_tiny_model

from tierserve.cache import hicache
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.procs.ranks import HOST, RankSpec, join

pytestmark = [pytest.mark.integration, pytest.mark.slow]
COPY_PAGES = hicache.copy_pages

LAYERS = 4
STAGES = 2
TIMEOUT_S = 30.0  # every collective's
LAG_S = 0.2  # the lagging stage's delay per copy call: many engine steps long
# stage -> (delay of each L1 -> L2 write, delay of each layer of an L2 -> L1 load)
DELAYS = {0: (0.0, LAG_S), 1: (LAG_S, 0.0)}


def _config(model: Path) -> EngineConfig:
    return EngineConfig(model, device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=512,
                        chunked_prefill_size=16, enable_hierarchical_cache=True, pp_size=STAGES,
                        dist_timeout_s=TIMEOUT_S)


def _lagging_copies(stage: int):
    """``copy_pages`` that first sleeps this stage's delay for its direction."""
    write_delay, load_delay = DELAYS[stage]

    def copy(*args: object) -> None:  # copy_pages(device, host, device pages, host pages, to_host, ...)
        time.sleep(write_delay if args[4] else load_delay)
        return COPY_PAGES(*args)

    return copy


def _stage(rank: int, port: int, model: str, skip: bool, out: str) -> None:
    store = dist.TCPStore(HOST, port, STAGES, is_master=True, wait_for_workers=False) if rank == 0 else None
    inject_here(Path(f"{out}.faults.json"), skip_agreement=skip)  # before the engine builds its cache
    config = _config(Path(model))
    engine = Engine(config, ranks=join(RankSpec(rank, STAGES, port, TIMEOUT_S), config, store))
    hicache.copy_pages = _lagging_copies(engine.ranks.pp.stage)
    digests: list[str] = []
    cold = run_agreed(engine, "cold", PROMPT, digests)  # write-through: its pages reach L2, late on stage 1
    l1 = run_agreed(engine, "l1", PROMPT, digests)
    engine.cache.flush(True, False)  # L1 only (every stage at the same point): the next match loads from L2
    digests.append(digest(engine))
    l2 = run_agreed(engine, "l2", PROMPT, digests)  # loads, late on stage 0
    extended = run_agreed(engine, "extended", [*PROMPT, 7, 8, 9, 10, 11], digests)
    report_and_leave(engine, out, {"cold": cold, "l1": l1, "l2": l2, "extended": extended, "digests": digests,
                                   "host_layers": engine.cache.host.geometry.num_layers})


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), heads=8, kv_heads=4, layers=LAYERS)


def test_stages_with_transfers_lagging_differently_keep_the_same_tree_every_step(model: Path, tmp_path: Path) -> None:
    skip = os.environ.get("TIERSERVE_TEST_SKIP_AGREEMENT") == "1"
    first, second = rank_reports(_stage, lambda s, port, out: (s, port, str(model), skip, out), STAGES, tmp_path,
                                 6 * TIMEOUT_S)
    assert_same_tree_every_step(first, second)
    for r in (first, second):
        assert r["host_layers"] == LAYERS // STAGES  # each stage's L2 holds its layers only
        assert sum(r["cold"][1].values()) == 0, r["cold"]
        assert r["l1"][0] == r["cold"][0] and r["l1"][1]["device"] >= 16 * PAGE, r["l1"]
        assert r["l2"][0] == r["cold"][0] and r["l2"][1]["host"] >= 16 * PAGE, r["l2"]
        assert r["extended"][1]["device"] >= 16 * PAGE, r["extended"]
    assert first["extended"][0] == second["extended"][0]

