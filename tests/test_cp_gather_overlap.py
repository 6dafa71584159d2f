"""The CP gather overlaps compute (real rank processes over gloo, docs/cp.md "The per-layer gather"):
layer l+1's pages are gathered while layer l computes. And a split step's K/V exchange (docs/cp.md, "How
the ranks split the compute") overlaps each rank's attention over the prefix and its own keys.

Each layer's gather and each layer's compute are slowed on purpose (both wrapped in the rank
processes only): a gather's wait ends no sooner than ``DELAY_S`` after the gather started, and each
attention sleeps ``DELAY_S`` before it reads its layer. The step that reads a cached prefix must
cost less than gathering then computing every layer in turn. With ``TIERSERVE_TEST_SYNC_GATHER=1``
each layer's gather starts only when its attention waits for it (no overlap), and this test fails. The
split step's test slows each exchange and each rank's early parts alike; with
``TIERSERVE_TEST_SYNC_EXCHANGE=1`` each exchange is waited for as soon as it starts, and it fails."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.rank_agreement import PAGE, PROMPT, rank_reports, report_and_leave, run_agreed
from helpers.tiny_models import make_tiny_model

from tierserve.engine.config import CPAttention, EngineConfig
from tierserve.engine.cp import gather, split
from tierserve.engine.engine import Engine
from tierserve.engine.procs.ranks import HOST, RankSpec, join
from tierserve.model import attention

pytestmark = [pytest.mark.integration, pytest.mark.slow]
FORWARD = attention.PagedAttention.forward
START = gather.LayerGather._start
BEFORE_ATTENTION = gather.LayerGather.before_attention
LOCAL_PARTS = split.SplitAttention._local_parts
START_EXCHANGE = split.SplitAttention._start_exchange

LAYERS = 4
TIMEOUT_S = 30.0  # every collective's
DELAY_S = 0.3  # each layer's gather, and each layer's compute
# merge: layer 0 merges, layers 1.. gather (a step of a few new tokens over a cached prefix); gather: every layer
MODES = {"merge": CPAttention.MERGE, "gather": CPAttention.GATHER}
TAIL = [(t * 11 + 5) % 380 + 2 for t in range(20)]  # new tokens after the cached PROMPT: more than a page
SPLIT_PROMPT = [(t * 7 + 3) % 380 + 2 for t in range(400)]  # one step, long enough to split (the model's 512 fit)


class _Late:
    """A gather's handle whose wait ends no sooner than ``DELAY_S`` after the gather started."""

    def __init__(self, handle: dist.Work) -> None:
        self.handle, self.ready_at = handle, time.perf_counter() + DELAY_S

    def wait(self) -> bool:
        self.handle.wait()
        time.sleep(max(0.0, self.ready_at - time.perf_counter()))
        return True


class _SlowDist:
    """``torch.distributed`` as the gather module sees it, with slow ``all_gather``s."""

    def __getattr__(self, name: str) -> object:
        return getattr(dist, name)

    @staticmethod
    def all_gather(*args: object, **kwargs: object) -> _Late:
        return _Late(dist.all_gather(*args, **kwargs))


def _slow_forward(self, *args: object):  # PagedAttention.forward, before it waits for its layer's gather
    time.sleep(DELAY_S)
    return FORWARD(self, *args)


def _synchronous_gathers() -> None:
    """The overlap off, to show the test can fail: a layer's gather starts when its attention waits."""
    def start_later(self: gather.LayerGather, layer_id: int) -> None:
        self.deferred = layer_id

    def start_now_then_wait(self: gather.LayerGather, layer_id: int) -> None:
        if getattr(self, "deferred", None) == layer_id:
            START(self, layer_id)
        BEFORE_ATTENTION(self, layer_id)

    gather.LayerGather._start = start_later
    gather.LayerGather.before_attention = start_now_then_wait


def _engine(rank: int, port: int, model: str, mode: str) -> Engine:
    store = dist.TCPStore(HOST, port, 2, is_master=True, wait_for_workers=False) if rank == 0 else None
    config = EngineConfig(Path(model), device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=512,
                          chunked_prefill_size=128, cp_size=2, cp_attention=MODES[mode], dist_timeout_s=TIMEOUT_S)
    return Engine(config, ranks=join(RankSpec(rank, 2, port, TIMEOUT_S), config, store))


def _overlap_rank(rank: int, port: int, model: str, mode: str, synchronous: bool, out: str) -> None:
    engine = _engine(rank, port, model, mode)
    run_agreed(engine, "cold", PROMPT)  # its pages stay in the tree, owned by both ranks in turn
    gather.dist = _SlowDist()
    attention.PagedAttention.forward = _slow_forward
    if synchronous:
        _synchronous_gathers()
    seconds: list[float] = []
    warm = run_agreed(engine, "warm", PROMPT + TAIL, step_seconds=seconds)
    report_and_leave(engine, out, {"warm": warm, "first_step_s": seconds[0],
                                   "gather": engine.runner.cp.gather_clock.stats()})


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), heads=8, kv_heads=4, layers=LAYERS)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_cp_gather_of_the_next_layer_overlaps_the_compute_of_this_one(model: Path, tmp_path: Path,
                                                                         mode: str) -> None:
    synchronous = os.environ.get("TIERSERVE_TEST_SYNC_GATHER") == "1"
    args = (str(model), mode, synchronous)
    for r in rank_reports(_overlap_rank, lambda rank, port, out: (rank, port, *args, out), 2, tmp_path,
                          4 * TIMEOUT_S):
        assert r["warm"][1].get("device", 0) >= 16 * PAGE, r["warm"]  # the step read the cached prefix
        assert r["gather"]["cp_gather_later_span_seconds_total"] > 0, r["gather"]  # layers 1.. gathered
        # overlapped: every layer's compute with the next gather behind it (~LAYERS delays); gathering
        # then computing each layer in turn costs 2 * LAYERS delays (LAYERS + 1 with layer 0 merged)
        gathered = LAYERS - (1 if mode == "merge" else 0)
        serial = (LAYERS + gathered) * DELAY_S
        assert r["first_step_s"] < serial - DELAY_S, f"{r['first_step_s']:.2f} s: the gathers did not overlap"


def _slow_local_parts(self, *args: object):  # a split step's attention before its exchange ends
    time.sleep(DELAY_S)
    return LOCAL_PARTS(self, *args)


def _exchange_waited_at_once(self, *args: object):
    """The overlap off, to show the test can fail: the exchange is waited for as soon as it starts."""
    started = START_EXCHANGE(self, *args)
    started[0].wait()
    return started


def _split_rank(rank: int, port: int, model: str, synchronous: bool, out: str) -> None:
    store = dist.TCPStore(HOST, port, 2, is_master=True, wait_for_workers=False) if rank == 0 else None
    config = EngineConfig(Path(model), device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=2048,
                          chunked_prefill_size=len(SPLIT_PROMPT), cp_size=2, dist_timeout_s=TIMEOUT_S)
    engine = Engine(config, ranks=join(RankSpec(rank, 2, port, TIMEOUT_S), config, store))
    split.dist = _SlowDist()
    split.SplitAttention._local_parts = _slow_local_parts
    if synchronous:
        split.SplitAttention._start_exchange = _exchange_waited_at_once
    seconds: list[float] = []
    run_agreed(engine, "split", SPLIT_PROMPT, step_seconds=seconds)
    report_and_leave(engine, out, {"first_step_s": seconds[0], "split": engine.runner.cp.split_clock.stats()})


def test_a_split_steps_kv_exchange_overlaps_the_attention_over_the_prefix_and_own_keys(model: Path,
                                                                                      tmp_path: Path) -> None:
    synchronous = os.environ.get("TIERSERVE_TEST_SYNC_EXCHANGE") == "1"
    for r in rank_reports(_split_rank, lambda rank, port, out: (rank, port, str(model), synchronous, out), 2,
                          tmp_path, 4 * TIMEOUT_S):
        assert r["split"]["cp_split_steps_total"] == 1, r["split"]  # the prompt's one step split
        # overlapped: each layer's exchange behind its early parts (~LAYERS delays); in turn 2 * LAYERS
        serial = 2 * LAYERS * DELAY_S
        assert r["first_step_s"] < serial - DELAY_S, f"{r['first_step_s']:.2f} s: the exchanges did not overlap"
