"""pp_sync: two real pipeline stages (gloo), each with its own HiCache over its own layers, whose
L1 -> L2 writes and L2 -> L1 loads finish at different times (injected per stage: stage 0's loads
lag, stage 1's writes lag). Every stage applies cache changes in the same order, so after every
step both hold the same tree (a digest per step: tokens, page ids, write and load states), and
answers from L1 and L2 equal the cold answer. With the agreement switched off
(``TIERSERVE_TEST_SKIP_AGREEMENT=1``, to prove the test can fail) each stage applies its own
finished transfers, the trees differ at some step, and this test fails."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.tiny_models import make_tiny_model

from tierserve.cache import hicache
from tierserve.cache.factory import SKIP_AGREEMENT
from tierserve.cache.options import HiCacheOptions
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.procs.ranks import HOST, RankSpec, join, leave
from tierserve.launch import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
COPY_PAGES = hicache.copy_pages

PAGE = 4
LAYERS = 4
STAGES = 2
PROMPT = torch.randint(2, 384, (70,), generator=torch.Generator().manual_seed(5)).tolist()  # 17 full pages
TIMEOUT_S = 30.0  # every collective's
LAG_S = 0.2  # the lagging stage's delay per copy call: many engine steps long
# stage -> (delay of each L1 -> L2 write, delay of each layer of an L2 -> L1 load)
DELAYS = {0: (0.0, LAG_S), 1: (LAG_S, 0.0)}


def _config(model: Path, skip: bool) -> EngineConfig:
    options = HiCacheOptions(storage_config={SKIP_AGREEMENT: skip})
    return EngineConfig(model, device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=512,
                        chunked_prefill_size=16, enable_hierarchical_cache=True, hicache=options, pp_size=STAGES,
                        dist_timeout_s=TIMEOUT_S)


def _lagging_copies(stage: int):
    """``copy_pages`` that first sleeps this stage's delay for its direction."""
    write_delay, load_delay = DELAYS[stage]

    def copy(*args: object) -> None:  # copy_pages(device, host, device pages, host pages, to_host, ...)
        time.sleep(write_delay if args[4] else load_delay)
        return COPY_PAGES(*args)

    return copy


def _digest(engine: Engine) -> str:
    """The stage's tree: every node's tokens, device and host pages, and write and load states."""
    nodes = sorted((list(n.tokens), list(n.device or []), list(n.host or []), bool(n.writing),
                    n.loading is not None) for n in engine.cache.tree.nodes())
    return hashlib.sha256(json.dumps(nodes).encode()).hexdigest()[:16]


def _run(engine: Engine, request_id: str, prompt: list[int], digests: list[str]) -> tuple[list[int], dict]:
    """Runs ``prompt`` to its end, then steps until the cache's copies landed; every stage steps
    while any has work (one collective per turn), so the stages take the same steps. Records the
    tree's digest after every step."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    tiers: dict[str, int] = {}
    while engine.ranks.agree_min(-int(engine.has_work())) < 0:
        for out in engine.step():
            tokens += out.new_token_ids
            tiers = out.cached_by_tier or tiers
        digests.append(_digest(engine))
    return tokens, tiers


def _stage(rank: int, port: int, model: str, skip: bool, out: str) -> None:
    store = dist.TCPStore(HOST, port, STAGES, is_master=True, wait_for_workers=False) if rank == 0 else None
    config = _config(Path(model), skip)
    engine = Engine(config, ranks=join(RankSpec(rank, STAGES, port, TIMEOUT_S), config, store))
    hicache.copy_pages = _lagging_copies(engine.ranks.pp.stage)
    digests: list[str] = []
    cold = _run(engine, "cold", PROMPT, digests)  # write-through: its pages reach L2, late on stage 1
    l1 = _run(engine, "l1", PROMPT, digests)
    engine.cache.flush(True, False)  # L1 only (every stage at the same point): the next match loads from L2
    digests.append(_digest(engine))
    l2 = _run(engine, "l2", PROMPT, digests)  # loads, late on stage 0
    extended = _run(engine, "extended", [*PROMPT, 7, 8, 9, 10, 11], digests)
    Path(out).write_text(json.dumps({"cold": cold, "l1": l1, "l2": l2, "extended": extended, "digests": digests,
                                     "host_layers": engine.cache.host.geometry.num_layers}))
    engine.ranks.agree_min(0)  # neither leaves before the other is done
    engine.cache.close()
    leave()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), heads=8, kv_heads=4, layers=LAYERS)


def _run_stages(args: list[tuple]) -> list[int | None]:
    """One spawned process per stage; their exit codes. A stage still running after its deadline
    is killed (so a hung collective fails the test instead of hanging it)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_stage, args=a) for a in args]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=6 * TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [p.exitcode for p in procs]


def test_stages_with_transfers_lagging_differently_keep_the_same_tree_every_step(model: Path, tmp_path: Path) -> None:
    skip = os.environ.get("TIERSERVE_TEST_SKIP_AGREEMENT") == "1"
    outs = [tmp_path / f"stage{s}.json" for s in range(STAGES)]
    port = free_port()
    codes = _run_stages([(s, port, str(model), skip, str(outs[s])) for s in range(STAGES)])
    assert codes == [0, 0], "a stage failed (diverged stages time out or disagree)"
    first, second = (json.loads(o.read_text()) for o in outs)
    assert len(first["digests"]) == len(second["digests"])
    for step, (a, b) in enumerate(zip(first["digests"], second["digests"], strict=True)):
        assert a == b, f"the stages' trees differ after step {step}"
    for r in (first, second):
        assert r["host_layers"] == LAYERS // STAGES  # each stage's L2 holds its layers only
        assert sum(r["cold"][1].values()) == 0, r["cold"]
        assert r["l1"][0] == r["cold"][0] and r["l1"][1]["device"] >= 16 * PAGE, r["l1"]
        assert r["l2"][0] == r["cold"][0] and r["l2"][1]["host"] >= 16 * PAGE, r["l2"]
        assert r["extended"][1]["device"] >= 16 * PAGE, r["extended"]
    assert first["extended"][0] == second["extended"][0]

