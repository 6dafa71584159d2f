"""HiCache on every rank of a multi-rank ``tierserve serve`` node (TP, CP or PP) through the OpenAI
API, with a real ``mooncake_master`` per test:

- at TP=2 and CP=2, answers served from L1, L2 and L3 equal ``transformers``' (no cache); at CP=2,
  rank 0's host pool holds only its own pages while the node's L2 holds more than one rank's pool;
- L3 pages written at one size are read at another, at least 90% of the prompt from storage, with
  the same answer: TP 2 -> 1 and 4, TP 1 and 4 -> 2 (objects by KV head range); CP 2 -> 1 and 1 -> 2
  (whole-page objects under the page key, each page written and restored by its owner rank);
  PP 2 -> 2 and 1, PP 1 -> 2 (objects by layer range, each stage its own layers); on 3 layers, uneven
  stages: PP 2 (2 + 1) -> PP 3 and PP 1, PP 3 -> PP 2;
- composed: at TP 2 x CP 2 and PP 2 x CP 2 (four ranks each), answers from L1, L2 and L3 equal
  ``transformers``'; L3 pages written at TP 2 x CP 2 are read at TP 1, CP 2 and TP 2, and pages
  written at TP 1, CP 2 and TP 2 are read at TP 2 x CP 2 (objects by head range, each written by
  its page's owner);
- TP only: the finer objects a writer told the cluster's TP sizes stores serve a TP 2 reader; a
  rank whose store shows fewer pages shortens the node's L3 hit; replicated KV heads are written
  once and read at TP 1."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers import metrics
from helpers.injected_faults import node_env, write_faults
from helpers.polling import poll
from helpers.processes import MasterProcess
from helpers.rank_hicache import (
    KV_HEADS,
    PAGE,
    assert_hits_l1_then_l2,
    complete,
    hicache_flags,
    remove_from_l3,
    seed,
    wait_backed_up,
    wait_in_l3,
)
from helpers.rank_servers import TPServer, hf_greedy, start_server
from helpers.tiny_models import add_word_tokenizer, make_tiny_model

from tierserve.cache.hashing import Namespace, page_keys
from tierserve.cache.options import HostLayout, object_format
from tierserve.cache.sharded.shards import HeadRange, LayerRange, object_key
from tierserve.model.identity import model_identity
from tierserve.model.pipeline import PipelineStage

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT_TOKENS = 70  # 17 full pages
PP_LAYERS = {"pp": 4, "ppu": 3}  # two per stage at PP 2; "ppu": uneven stages, 2 + 1 at PP 2
STATS_DEADLINE_S = 30.0
# each layout's prompts: (seed, how many); "tpcp": TP 2 x CP 2, "ppcp": PP 2 x CP 2 (on the PP model)
SEEDS = {"tp": (11, 8), "cp": (15, 6), "pp": (21, 2), "ppu": (31, 2), "tpcp": (41, 7), "ppcp": (51, 4)}
WRITERS = {"tp": "tp2", "cp": "cp2", "ppcp": "pp2cp2"}  # the two- and four-rank nodes
DEVICE_PAGES = {"tp": 48, "cp": 24, "tpcp": 24, "ppcp": 24}  # per rank: 48 in all, L1 of the L2 test


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny Llamas of 8 heads and 4 KV heads with the word tokenizer: 2 layers (TP, CP, TP x CP), 4 (PP,
    PP x CP), 3 (PP uneven)."""
    two = make_tiny_model("llama", tmp_path_factory.mktemp("llama"), heads=8, kv_heads=KV_HEADS)
    more = {layout: add_word_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp(f"llama{n}"), heads=8,
                                                       kv_heads=KV_HEADS, layers=n)) for layout, n in PP_LAYERS.items()}
    two = add_word_tokenizer(two)
    return {"tp": two, "cp": two, "tpcp": two, "ppcp": more["pp"], **more}


@pytest.fixture(scope="module")
def asked() -> dict[str, list[list[int]]]:
    """Each layout's distinct prompts of ``PROMPT_TOKENS``: no test's pages can serve another's."""
    out = {}
    for layout, (seed_, n) in SEEDS.items():
        gen = torch.Generator().manual_seed(seed_)
        out[layout] = [torch.randint(2, 384, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(n)]
    return out


@pytest.fixture(scope="module")
def expected(models, asked) -> dict[str, list[list[int]]]:
    return {layout: hf_greedy(models[layout], prompts) for layout, prompts in asked.items()}


def spawn(node: str, model: Path, log: Path, master: MasterProcess, max_tokens: int = 2048,
          faults: dict | None = None, tp_sizes: list[int] | None = None) -> TPServer:
    """Starts (not waiting) a node of the sizes ``node`` names, e.g. "tp2cp2" or "pp2" (sizes not
    named are 1; a suffix after "-" only tells two nodes of one layout apart)."""
    sizes = dict(re.findall(r"(tp|cp|pp)(\d+)", node.split("-")[0]))
    ranks = [flag for k in ("cp", "pp") if k in sizes for flag in (f"--{k}-size", sizes[k])]
    flags = hicache_flags(master, max_tokens, tp_sizes)
    env = node_env(write_faults(log.with_suffix(".faults.json"), faults)) if faults else None
    return start_server(model, int(sizes.get("tp", 1)), log, *ranks, *flags, env=env)


class Nodes:
    """A test's nodes of one model, started together (their loads overlap) and stopped together. A
    node plays every part it has in the test, writer of one prompt and reader of another, each
    prompt new to it, so it reads that prompt from L3 as a fresh node would; writers stay up (their
    Mooncake segments hold the objects)."""

    def __init__(self, model: Path, logs: Path, master: MasterProcess, *names: str,
                 options: dict[str, dict[str, Any]] | None = None) -> None:
        """``options``: a node's ``spawn`` keywords (``max_tokens``, ``faults``, ``tp_sizes``) by name."""
        self._up: dict[str, TPServer] = {}
        try:
            for name in names:
                self._up[name] = spawn(name, model, logs / f"{name}.log", master, **(options or {}).get(name, {}))
            for node in self._up.values():
                node.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def __getitem__(self, name: str) -> TPServer:
        return self._up[name]

    def stop(self) -> None:
        for node in self._up.values():
            node.stop()


def pp_object_names(model: Path, tokens: list[int], pp_size: int, layers: int) -> list[bytes]:
    """Every object a TP=1 node of ``pp_size`` stages (the default split of ``layers``) writes for
    the prompt's full pages."""
    seed_ = Namespace(model_identity(model), "float32", PAGE, layers, KV_HEADS, 16,
                      object_format(HostLayout.PAGE_FIRST_DIRECT)).seed()
    keys = page_keys(seed_, tokens[: len(tokens) // PAGE * PAGE], PAGE)
    stages = [PipelineStage(s, pp_size).layers(layers) for s in range(pp_size)]
    ranges = [LayerRange(r.start, len(r), layers) for r in stages]
    return [object_key(k, HeadRange(0, KV_HEADS, KV_HEADS), r) for k in keys for r in ranges]


def wait_written(layout: str, master: MasterProcess, model: Path, prompt: list[int], size: int) -> None:
    """Polls L3 until it holds every object a writer of ``size`` ranks in ``layout`` stores for the
    prompt: by KV head range (TP, TP 2 x CP 2 as TP 2), whole pages under the page key as at TP 1 (CP),
    by layer range (PP, PP 2 x CP 2 as PP 2)."""
    if layout == "ppcp":
        wait_in_l3(master, pp_object_names(model, prompt, 2, PP_LAYERS["pp"]))
    elif layout.startswith("pp"):
        wait_in_l3(master, pp_object_names(model, prompt, size, PP_LAYERS[layout]))
    else:
        wait_backed_up(master, model, prompt, {"tp": size, "tpcp": 2}.get(layout, 1))


def assert_host_pool_holds_own_pages(server: TPServer) -> None:
    """Rank 0 holds about half of the L2 pages in use (its own), never more than its own pool,
    while the node's L2 holds more pages than one rank's pool: the host tier is sharded."""
    gauges = poll(lambda: metrics.by_suffix(httpx.get(f"{server.url}/metrics", timeout=10).text, "tierserve_cache_"),
                  lambda g: g.get("host_pages_used", 0) > g.get("host_rank_pages_total", 1e9),
                  "L2 past one rank's pool on /metrics (stats are published a step late)", STATS_DEADLINE_S)
    used, mine, pool = gauges["host_pages_used"], gauges["host_rank_pages_used"], gauges["host_rank_pages_total"]
    assert gauges["host_pages_total"] == 2 * pool, gauges
    assert mine <= pool and abs(2 * mine - used) <= 16, gauges  # an odd node is off by one page


@pytest.mark.parametrize(("layout", "reader"), [("tp", "tp2"), ("cp", "cp2"), ("ppcp", "pp2cp2")],
                         ids=["tp2", "cp2", "pp2cp2"])
def test_multi_rank_nodes_answer_from_l1_l2_and_l3_equal_no_cache(models, asked, expected, master, tmp_path: Path,
                                                                  layout: str, reader: str) -> None:
    """TP: 48 device pages; CP (alone or composed): 24 per CP rank, 48 in all: three other prompts (22
    pages each) push the first out of L1 into L2 only. Then a node of the writer's layout takes a
    prompt from L3."""
    model, asked, expected = models[layout], asked[layout], expected[layout]
    writer = WRITERS[layout]
    nodes = Nodes(model, tmp_path, master, writer, f"{reader}-reader",
                  options={writer: {"max_tokens": DEVICE_PAGES[layout] * PAGE}})
    try:
        assert_hits_l1_then_l2(nodes[writer], model, asked, expected)
        if layout != "tp":
            assert_host_pool_holds_own_pages(nodes[writer])
        wait_written(layout, master, model, asked[1], 2)
        answer, tiers = complete(nodes[f"{reader}-reader"], model, asked[1])
        assert answer == expected[1] and tiers["storage"] >= 0.9 * PROMPT_TOKENS, tiers
    finally:
        nodes.stop()


def test_tp2_x_cp2_pages_are_read_at_tp1_cp2_and_tp2_and_theirs_at_tp2_x_cp2(models, asked, expected, master,
                                                                            tmp_path: Path) -> None:
    """A TP 2 x CP 2 node (24 device pages per CP rank, 48 in all) answers from L1, L2 and L3 as no
    cache; the TP 1, CP 2 and TP 2 nodes read its prompt from L3, then each writes a prompt of its
    own that the TP 2 x CP 2 node reads from L3, each with the writer's answer."""
    model, asked, expected = models["tpcp"], asked["tpcp"], expected["tpcp"]
    others = {"tp1": (4, 1), "cp2": (5, 1), "tp2": (6, 2)}  # node: (its prompt, its KV head ranges)
    nodes = Nodes(model, tmp_path, master, "tp2cp2", *others,
                  options={"tp2cp2": {"max_tokens": DEVICE_PAGES["tpcp"] * PAGE}})
    try:
        assert_hits_l1_then_l2(nodes["tp2cp2"], model, asked, expected)
        assert_host_pool_holds_own_pages(nodes["tp2cp2"])
        wait_written("tpcp", master, model, asked[1], 2)
        for node, (prompt, heads) in others.items():
            answer, tiers = complete(nodes[node], model, asked[1])
            assert answer == expected[1] and tiers["storage"] >= 0.9 * PROMPT_TOKENS, (node, tiers)
            assert complete(nodes[node], model, asked[prompt])[0] == expected[prompt], node
            wait_backed_up(master, model, asked[prompt], heads)
        for prompt, _ in others.values():
            answer, tiers = complete(nodes["tp2cp2"], model, asked[prompt])
            assert answer == expected[prompt] and tiers["storage"] >= 0.9 * PROMPT_TOKENS, (prompt, tiers)
    finally:
        nodes.stop()


# each layout's cases, (writer, readers, prompt), over one set of nodes: "-b" is a second node of one layout
ACROSS = {
    "tp": (("tp2", ("tp1", "tp4"), 4), ("tp1", ("tp2",), 5), ("tp4", ("tp2",), 6)),
    "cp": (("cp2", ("cp1",), 4), ("cp1", ("cp2",), 5)),
    "pp": (("pp2", ("pp2-b", "pp1"), 0), ("pp1", ("pp2",), 1)),
    "ppu": (("pp2", ("pp3", "pp1"), 0), ("pp3", ("pp2",), 1)),  # 3 layers: PP 2 is uneven (2 + 1)
}


@pytest.mark.parametrize("layout", list(ACROSS))
def test_l3_pages_are_read_across_sizes(models, asked, expected, master, tmp_path: Path, layout: str) -> None:
    """TP 2 -> 1 and 4, 1 -> 2, 4 -> 2; CP 2 -> 1, 1 -> 2; PP 2 -> 2 and 1, 1 -> 2; uneven PP 2 of 3
    layers -> 3 and 1, 3 -> 2. A prompt of its own per case (no other case's pages can serve it)."""
    model, asked, expected = models[layout], asked[layout], expected[layout]
    names = dict.fromkeys(n for writer, readers, _ in ACROSS[layout] for n in (writer, *readers))
    nodes = Nodes(model, tmp_path, master, *names)
    try:
        for writer, readers, prompt in ACROSS[layout]:
            assert complete(nodes[writer], model, asked[prompt]) == (expected[prompt], {"device": 0, "host": 0,
                                                                                         "storage": 0})
            wait_written(layout, master, model, asked[prompt], int(writer[2]))
            for reader in readers:
                answer, tiers = complete(nodes[reader], model, asked[prompt])
                assert answer == expected[prompt], (writer, reader)
                assert tiers["storage"] >= 0.9 * PROMPT_TOKENS, (writer, reader, tiers)
    finally:
        nodes.stop()


# ---- TP only -----------------------------------------------------------------------------------


def test_a_tp1_writer_told_the_cluster_tp_sizes_stores_halves_that_tp2_ranks_read(models, asked, expected, master,
                                                                                    tmp_path: Path) -> None:
    """A TP=1 node with ``l3_tp_sizes`` [1, 2] stores every page whole and in halves; with the
    whole objects removed, a TP=2 node still takes the prompt from L3, from the halves alone."""
    model, asked, expected = models["tp"], asked["tp"], expected["tp"]
    nodes = Nodes(model, tmp_path, master, "tp1", "tp2", options={"tp1": {"tp_sizes": [1, 2]}})
    try:
        assert complete(nodes["tp1"], model, asked[3])[0] == expected[3]
        keys = page_keys(seed(model), asked[3][: PROMPT_TOKENS // PAGE * PAGE], PAGE)
        wait_in_l3(master, keys + [object_key(k, HeadRange(h, 2, KV_HEADS)) for k in keys for h in (0, 2)])
        remove_from_l3(master, keys)
        answer, tiers = complete(nodes["tp2"], model, asked[3])
        assert answer == expected[3] and tiers["storage"] >= 0.9 * PROMPT_TOKENS, tiers
    finally:
        nodes.stop()


def test_a_rank_that_sees_fewer_l3_pages_shortens_the_hit_of_the_node(models, asked, expected, master,
                                                                      tmp_path: Path) -> None:
    """Rank 1's store shows 6 pages (test fault, its process only): the node takes 6 pages from L3
    on both ranks and computes the rest, with the answer of no cache."""
    model, asked, expected = models["tp"], asked["tp"], expected["tp"]
    nodes = Nodes(model, tmp_path, master, "tp2", "tp2-reader",
                  options={"tp2-reader": {"faults": {"ranks": [1], "exists_cap": 6}}})
    try:
        assert complete(nodes["tp2"], model, asked[7])[0] == expected[7]
        wait_backed_up(master, model, asked[7], 2)
        answer, tiers = complete(nodes["tp2-reader"], model, asked[7])
        again = complete(nodes["tp2-reader"], model, asked[7])[0]  # its tree is whole on both ranks
        assert answer == again == expected[7] and tiers["storage"] == 6 * PAGE, tiers
    finally:
        nodes.stop()


def test_replicated_kv_heads_are_written_once_and_read_at_tp1(master, tmp_path: Path) -> None:
    """Qwen3 with 2 KV heads at TP=4: ranks 0 and 2 write heads 0 and 1 (their neighbours replicate
    them and write nothing); a TP=1 node reads both objects of every page."""
    qwen3 = add_word_tokenizer(make_tiny_model("qwen3", tmp_path / "qwen3", heads=8, kv_heads=2))
    prompt = torch.randint(2, 384, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(12)).tolist()
    expected = hf_greedy(qwen3, [prompt])[0]
    nodes = Nodes(qwen3, tmp_path, master, "tp4", "tp1")
    try:
        assert complete(nodes["tp4"], qwen3, prompt)[0] == expected
        keys = page_keys(seed(qwen3, 2), prompt[: PROMPT_TOKENS // PAGE * PAGE], PAGE)
        wait_in_l3(master, [object_key(k, HeadRange(h, 1, 2)) for k in keys for h in (0, 1)])
        answer, tiers = complete(nodes["tp1"], qwen3, prompt)
        assert answer == expected and tiers["storage"] >= 0.9 * PROMPT_TOKENS, tiers
    finally:
        nodes.stop()
