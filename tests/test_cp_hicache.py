"""HiCache under context parallelism (``tierserve serve --cp-size 2 --enable-hierarchical-cache``)
through the OpenAI API with a real ``mooncake_master``: each page is written to L2 and L3 and
restored by its owner rank only. Answers served from L1, L2 and L3 equal ``transformers``' (no
cache); rank 0's host pool holds only its own pages while the node's L2 holds more than one rank's
pool could; L3 pages written at CP=2 are read at CP=1 and the reverse (whole-page objects under the
page key), at least 90% of the prompt from storage, with the same answer."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers.processes import MasterProcess
from helpers.rank_servers import TPServer, hf_greedy, start_server
from helpers.tiny_models import add_word_tokenizer, make_tiny_model
from test_tp_hicache import complete, hicache_flags, wait_backed_up

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PAGE = 4  # tp_server's page size
PROMPT_TOKENS = 70  # 17 full pages
STATS_DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return add_word_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("llama"), heads=8, kv_heads=4))


@pytest.fixture(scope="module")
def asked() -> list[list[int]]:
    """Distinct prompts, one per use below (no test's pages can serve another's)."""
    gen = torch.Generator().manual_seed(15)
    return [torch.randint(2, 384, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(6)]


@pytest.fixture(scope="module")
def expected(model: Path, asked: list[list[int]]) -> list[list[int]]:
    return hf_greedy(model, asked)



def serve(model: Path, cp_size: int, log: Path, master: MasterProcess, max_tokens: int = 2048) -> TPServer:
    """``max_tokens`` sizes one rank's device pool (at CP=2 the node holds twice as many)."""
    flags = hicache_flags(master, max_tokens)
    return start_server(model, 1, log, "--cp-size", str(cp_size), *flags).wait_healthy()


def cache_gauges(server: TPServer) -> dict[str, float]:
    """The prefix cache's ``/metrics`` values (rank 0's engine), by key without the prefix."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {k: float(v) for k, v in re.findall(r"^tierserve_cache_(\w+) (\S+)$", text, re.MULTILINE)}


def wait_gauges(server: TPServer, ready) -> dict[str, float]:
    """Polls ``/metrics`` until ``ready(gauges)`` (stats are published a step late)."""
    deadline = time.monotonic() + STATS_DEADLINE_S
    while not ready(gauges := cache_gauges(server)):
        assert time.monotonic() < deadline, gauges
        time.sleep(0.1)  # poll interval
    return gauges


def test_cp2_answers_from_l1_l2_and_l3_equal_no_cache(model, asked, expected, master, tmp_path: Path) -> None:
    # 24 device pages per rank, 48 in all: three other prompts (22 pages each) push the first into L2
    writer = serve(model, 2, tmp_path / "writer.log", master, max_tokens=24 * PAGE)
    try:
        assert complete(writer, model, asked[0]) == (expected[0], {"device": 0, "host": 0, "storage": 0})
        answer, tiers = complete(writer, model, asked[0])
        assert answer == expected[0] and tiers["device"] >= 16 * PAGE, tiers
        for i in (1, 2, 3):
            assert complete(writer, model, asked[i])[0] == expected[i]
        answer, tiers = complete(writer, model, asked[0])
        assert answer == expected[0] and tiers["host"] > 0, tiers
        assert_host_pool_holds_own_pages(writer)
        wait_backed_up(master, model, asked[1], 1)  # whole pages under the page key, as at CP=1
        reader = serve(model, 2, tmp_path / "reader.log", master)
        try:
            answer, tiers = complete(reader, model, asked[1])
        finally:
            reader.stop()
        assert answer == expected[1] and tiers["storage"] >= 0.9 * PROMPT_TOKENS, tiers
    finally:
        writer.stop()


def assert_host_pool_holds_own_pages(server: TPServer) -> None:
    """Rank 0 holds about half of the L2 pages in use (its own), never more than its own pool,
    while the node's L2 holds more pages than one rank's pool: the host tier is sharded."""
    gauges = wait_gauges(server, lambda g: g.get("host_pages_used", 0) > g.get("host_rank_pages_total", 1e9))
    used, mine, pool = gauges["host_pages_used"], gauges["host_rank_pages_used"], gauges["host_rank_pages_total"]
    assert gauges["host_pages_total"] == 2 * pool, gauges
    assert mine <= pool and abs(2 * mine - used) <= 16, gauges  # an odd node is off by one page


@pytest.mark.parametrize(("writer_cp", "reader_cp", "prompt"), [(2, 1, 4), (1, 2, 5)])
def test_l3_pages_are_shared_across_cp_sizes(model, asked, expected, master, tmp_path: Path, writer_cp: int,
                                             reader_cp: int, prompt: int) -> None:
    writer = serve(model, writer_cp, tmp_path / "writer.log", master)
    try:
        assert complete(writer, model, asked[prompt])[0] == expected[prompt]
        wait_backed_up(master, model, asked[prompt], 1)
        reader = serve(model, reader_cp, tmp_path / "reader.log", master)
        try:
            answer, tiers = complete(reader, model, asked[prompt])
        finally:
            reader.stop()
        assert answer == expected[prompt], (writer_cp, reader_cp)
        assert tiers["storage"] >= 0.9 * PROMPT_TOKENS, (writer_cp, reader_cp, tiers)
    finally:
        writer.stop()
