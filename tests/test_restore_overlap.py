"""L2 -> L1 restores at several ranks (real rank processes over gloo): layer l+1 copies while layer
l computes, and a restore failing on one rank only, mid-forward, fails its request on every rank.

The overlap test slows each layer's host -> device copy and each layer's compute on purpose (both
wrapped in the rank processes only): the step that restores the prompt must cost less than copying
every layer and then computing every layer. With ``TIERSERVE_TEST_WAIT_RESTORES_FIRST=1`` each rank
waits for its restores in full before the forward (the layer-by-layer overlap off, as before
docs/ranks.md had it), and that test fails."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.rank_agreement import PAGE, PROMPT, rank_reports, report_and_leave, run_agreed, tree_of
from helpers.tiny_models import make_tiny_model

from tierserve.cache import hicache
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import CPAttention, EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.procs.ranks import HOST, RankSpec, join
from tierserve.model import attention

pytestmark = [pytest.mark.integration, pytest.mark.slow]
COPY_PAGES = hicache.copy_pages
FORWARD = attention.PagedAttention.forward

LAYERS = 4
TIMEOUT_S = 30.0  # every collective's
DELAY_S = 0.3  # each layer's copy, and each layer's compute, in the overlap test
# layout -> EngineConfig sizes (two ranks each)
LAYOUTS = {"tp2": {"tp_size": 2}, "pp2": {"pp_size": 2}, "cp2-merge": {"cp_size": 2},
           "cp2-gather": {"cp_size": 2, "cp_attention": CPAttention.GATHER}}
OTHER = [(t * 7 + 3) % 380 + 2 for t in range(41)]  # a prompt sharing nothing with PROMPT


def _engine(rank: int, port: int, model: str, layout: str) -> Engine:
    store = dist.TCPStore(HOST, port, 2, is_master=True, wait_for_workers=False) if rank == 0 else None
    config = EngineConfig(Path(model), device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=512,
                          chunked_prefill_size=128, enable_hierarchical_cache=True, dist_timeout_s=TIMEOUT_S,
                          **LAYOUTS[layout])
    return Engine(config, ranks=join(RankSpec(rank, 2, port, TIMEOUT_S), config, store))


def _slow_copies(*args: object) -> None:  # copy_pages(device, host, device pages, host pages, to_host, ...)
    if args[4] is False:
        time.sleep(DELAY_S)
    return COPY_PAGES(*args)


def _slow_forward(self, *args: object):  # PagedAttention.forward, before it waits for its layer's restore
    time.sleep(DELAY_S)
    return FORWARD(self, *args)


def _restores_first(engine: Engine) -> None:
    """The overlap off, to show the test can fail: every restore waited for before the forward."""
    run = engine._run

    def waiting(batch: list, restores) -> object:
        for load in restores.loads:
            restores._wait(load, -1)
        return run(batch, restores)

    engine._run = waiting


def _overlap_rank(rank: int, port: int, model: str, first: bool, out: str) -> None:
    engine = _engine(rank, port, model, "tp2")
    cold = run_agreed(engine, "cold", PROMPT)  # write-through: its pages reach L2
    engine.cache.flush(True, False)  # L1 only: the next match restores from L2
    hicache.copy_pages = _slow_copies
    attention.PagedAttention.forward = _slow_forward
    if first:
        _restores_first(engine)
    seconds: list[float] = []
    warm = run_agreed(engine, "warm", PROMPT, step_seconds=seconds)
    report_and_leave(engine, out, {"cold": cold, "warm": warm, "first_step_s": seconds[0]})


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), heads=8, kv_heads=4, layers=LAYERS)


def test_l2_restores_at_tp2_overlap_the_compute_layer_by_layer(model: Path, tmp_path: Path) -> None:
    first = os.environ.get("TIERSERVE_TEST_WAIT_RESTORES_FIRST") == "1"
    for r in rank_reports(_overlap_rank, lambda r, port, out: (r, port, str(model), first, out), 2, tmp_path,
                          4 * TIMEOUT_S):
        assert r["warm"][0] == r["cold"][0], "a restored prefix changed the answer"
        assert r["warm"][1].get("host", 0) >= 16 * PAGE, r["warm"]  # the prompt came from L2
        # the restoring step: its first layer's copy, then every layer's compute with the next copy
        # behind it (~LAYERS + 1 delays); copying every layer first costs 2 * LAYERS delays
        serial = 2 * LAYERS * DELAY_S
        assert r["first_step_s"] < serial - 2 * DELAY_S, f"{r['first_step_s']:.2f} s: the restores did not overlap"


def _failing_midway(*args: object) -> None:
    """Rank 1's restores fail at their second layer: after the forward used the first."""
    layers = args[6]
    if args[4] is False and layers is not None and layers.start >= 1:
        raise RuntimeError("injected L2 -> L1 copy failure at layer >= 1")
    return COPY_PAGES(*args)


def _pair(engine: Engine) -> tuple[dict[str, list[int]], list[str]]:
    """Runs PROMPT (restored from L2) and OTHER (not cached) in one batch; each one's tokens, and
    the ids of the requests that failed."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("restored", PROMPT, params)
    engine.add_request("other", OTHER, params)
    tokens: dict[str, list[int]] = {"restored": [], "other": []}
    failed: list[str] = []
    while engine.ranks.agree_min(-int(engine.has_work())) < 0:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        failed += [rid for rid, _ in engine.take_failures()]
    return tokens, failed


def _failure_rank(rank: int, port: int, model: str, layout: str, out: str) -> None:
    engine = _engine(rank, port, model, layout)
    other = run_agreed(engine, "other-cold", OTHER)
    engine.cache.flush(True, True)  # OTHER stays uncached
    cold = run_agreed(engine, "cold", PROMPT)
    engine.cache.flush(True, False)  # L1 only: the next match restores PROMPT from L2
    if rank == 1:
        hicache.copy_pages = _failing_midway
    tokens, failed = _pair(engine)
    hicache.copy_pages = COPY_PAGES
    trees = [tree_of(engine)]
    warm = run_agreed(engine, "warm", PROMPT)
    report_and_leave(engine, out, {"cold": cold, "other": other, "pair": tokens, "failed": failed, "warm": warm,
                                   "trees": [*trees, tree_of(engine)]})


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_restore_failing_mid_forward_on_one_rank_fails_its_request_on_every_rank(
        model: Path, tmp_path: Path, layout: str) -> None:
    results = rank_reports(_failure_rank, lambda r, port, out: (r, port, str(model), layout, out), 2, tmp_path,
                           4 * TIMEOUT_S)
    assert results[0]["trees"] == results[1]["trees"]
    for r in results:
        assert r["failed"] == ["restored"]
        assert r["pair"] == {"restored": [], "other": r["other"][0][:6]}  # the batch's other request kept its step
        assert r["warm"][0] == r["cold"][0] and r["warm"][1].get("host", 0) > 0, r["warm"]
