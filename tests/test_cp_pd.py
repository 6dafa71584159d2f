"""A prefill node with context parallelism hands its KV to decode nodes without it (issue 15, item 5):
real node processes (each CP rank its own transfer engine over TCP, its pool holding only the pages
it owns), driven through gRPC as the router drives them. Each CP rank sends the pages it owns, from
its local slot, into the decode node's pages; outputs equal the single engine; the two ranks
together move exactly the KV bytes of the uncached prompt (a rank sending every page would move
twice that); a decode cache hit moves only the rest. A TP 2 x CP 2 prefill node (four ranks, each
sending its tensor rank's heads of the pages it owns) hands over to the same decode nodes, and a
PP 2 x CP 2 one (each rank its stage's layer of the pages it owns) to the TP 1 node. A decode node
with CP 2 ("dc2", issue 28 item 3) takes the KV of a CP 2, a TP 1 and a TP 2 x CP 2 prefill node, each
page written into its owner's slot only (the TP 2 x CP 2 ranks through the decode ranks' receive
staging); it continues the rotation of what it caches (a decode hit), and its continuous offload runs
under CP (pages of running requests reach L3 through the owners)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import metrics
from helpers.pd_nodes import DECODE_ARGS, MAX_NEW, NODE_ARGS, PAGE, idle, info, prompts, reference, run_all, run_pd
from helpers.polling import wait_for
from helpers.processes import NodeProcess, free_port
from helpers.tiny_models import make_tiny_model

from tierserve.core.sampling import SamplingParams
from tierserve.engine.commands import AHEAD_PROMPT_TOKENS
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.proto import tierserve_pb2 as pb

pytestmark = pytest.mark.integration
LAYERS = 2
TOKEN_BYTES = LAYERS * 2 * 4 * 16 * 4  # layers x (K, V) x the model's 4 KV heads x head dim x float32
SIZES = {"pc2": ("prefill", ["--cp-size", "2"]), "pt2c2": ("prefill", ["--tp-size", "2", "--cp-size", "2"]),
         "pp2c2": ("prefill", ["--pp-size", "2", "--cp-size", "2"]), "d1": ("decode", []),
         "dt2": ("decode", ["--tp-size", "2"]), "p1": ("prefill", []),
         "dc2": ("decode", ["--cp-size", "2", "--enable-hierarchical-cache", "--hicache-storage-backend", "file"])}
DC2_METRICS = free_port()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("cp_pd_llama"), heads=8, kv_heads=4, layers=LAYERS,
                           max_position=2048)


@pytest.fixture(scope="module")
def nodes(model: Path, tmp_path_factory) -> Iterator[dict[str, NodeProcess]]:
    """Prefill nodes at CP 2 ("pc2"), TP 2 x CP 2 ("pt2c2"), PP 2 x CP 2 ("pp2c2") and TP 1 ("p1"),
    decode nodes at TP 1 ("d1"), TP 2 ("dt2") and CP 2 ("dc2", with L2 and a file L3); every handoff's KV
    digested per layer and checked by the decode node (``--handoff-integrity``: each decode CP rank sums
    the pages it owns, each prefill rank what each decode owner takes)."""
    logs = tmp_path_factory.mktemp("cp-pd-logs")
    l3 = ["--hicache-storage-backend-extra-config", f'{{"path": "{tmp_path_factory.mktemp("dc2-l3")}"}}',
          "--metrics-port", str(DC2_METRICS)]
    started = {name: NodeProcess(role, ["--model", str(model), *(NODE_ARGS if role == "prefill" else DECODE_ARGS),
                                        *sizes, *(l3 if name == "dc2" else []), "--handoff-integrity"],
                                 logs / f"{name}.log")
               for name, (role, sizes) in SIZES.items()}
    try:
        yield {name: node.wait_ready() for name, node in started.items()}
    finally:
        for node in started.values():
            node.stop()


def _check_pairing(model: Path, prefill: str, decode: str, batch: list[list[int]], tag: str
                   ) -> list[pb.PrefillResponse]:
    """The batch through the pair: the single engine's answers, every token's KV sent once (the
    decode node caches none of it), and every page back on both nodes."""
    results = asyncio.run(run_all(prefill, decode, batch, tag))
    assert [tokens for tokens, _ in results] == reference(model, batch)
    assert [r.transferred_bytes for _, r in results] == [len(p) * TOKEN_BYTES for p in batch]
    wait_for(lambda: idle(prefill, decode), "every page back on both nodes", 10)
    return [r for _, r in results]


@pytest.mark.parametrize(("p", "d"), [("pc2", "d1"), ("pc2", "dt2"), ("pt2c2", "d1"), ("pt2c2", "dt2"),
                                      ("pp2c2", "d1"), ("pc2", "dc2"), ("p1", "dc2"), ("pt2c2", "dc2")])
def test_outputs_equal_the_single_engine_from_cp_2(model: Path, nodes, p: str, d: str) -> None:
    """Fresh prompts (one to five chunks: pages of both owners, rotations starting on either); into
    dc2, each page to its owner only (a rank writing every page would move twice the bytes)."""
    batch = prompts(4, seed=300 + 10 * list(SIZES).index(p) + len(d))  # each pair its own: no decode cache hit
    _check_pairing(model, nodes[p].address, nodes[d].address, batch, f"{p}{d}-")


def test_prefill_cache_hits_are_sent_by_their_owners(model: Path, nodes) -> None:
    """Prompts that extend ones the prefill node holds (served with dt2 before) go to d1, which holds
    none of them: the prefill node continues each cached prefix's rotation, and each owner sends
    its cached pages as well as its new ones."""
    batch = prompts(3, seed=310)
    _check_pairing(model, nodes["pc2"].address, nodes["dt2"].address, batch, "warm-")
    longer = [p + list(range(2, 2 + 2 * PAGE + 5)) for p in batch]
    responses = _check_pairing(model, nodes["pc2"].address, nodes["d1"].address, longer, "longer-")
    assert [r.cache.cached_tokens for r in responses] == [len(p) // PAGE * PAGE for p in batch]


@pytest.mark.parametrize("d", ["d1", "dc2"])
def test_a_decode_cache_hit_moves_only_the_uncached_tokens(model: Path, nodes, d: str) -> None:
    """At dc2 the second prompt's new pages continue the cached prefix's rotation, and its decode
    steps merge attention over a prefix whose pages both ranks hold."""
    prompt = prompts(1, seed=320 + len(d))[0] + list(range(2, 2 + 3 * PAGE))
    first, r1 = asyncio.run(run_pd(nodes["pc2"].address, nodes[d].address, f"cp-hit-a-{d}", prompt))
    more = prompt + list(range(5, 5 + 2 * PAGE + 3))  # extends it: D keeps the first prompt's whole pages
    again, r2 = asyncio.run(run_pd(nodes["pc2"].address, nodes[d].address, f"cp-hit-b-{d}", more))
    assert first == reference(model, [prompt])[0] and again == reference(model, [more])[0]
    held = len(prompt) // PAGE * PAGE
    assert r1.transferred_bytes == len(prompt) * TOKEN_BYTES
    assert r2.transferred_bytes == (len(more) - held) * TOKEN_BYTES


def test_continuous_offload_runs_on_a_cp_decode_node(nodes) -> None:
    """dc2's running requests put their full pages in the tree as they fill (not a no-op under CP:
    ``HiCache.checkpoint``) and their owners back them up to L3; no page of theirs was refused."""
    asyncio.run(run_pd(nodes["p1"].address, nodes["dc2"].address, "cp-offload", prompts(1, seed=330)[0] + [7] * 40))
    text = lambda: metrics.scrape(f"http://127.0.0.1:{DC2_METRICS}")  # noqa: E731
    assert metrics.value(text(), "tierserve_cache_offload_checkpoint_pages_total") > 0
    wait_for(lambda: metrics.value(text(), "tierserve_cache_l3_backup_pages_total") > 0, "a backup to L3", 20)
    assert metrics.value(text(), "tierserve_cache_cp_refused_pages_total") == 0


@pytest.mark.parametrize(("p", "tp", "pp", "cp"), [("pc2", 1, 1, 2), ("pt2c2", 2, 1, 2), ("pp2c2", 1, 2, 2),
                                                  ("dc2", 1, 1, 2), ("d1", 1, 1, 1)])
def test_info_reports_the_tensor_ranks_and_stages(nodes, p: str, tp: int, pp: int, cp: int) -> None:
    """The router's Reserve names the prefill node's TP size: a CP rank holds its tensor rank's KV heads.
    The router's decode choice reads the CP size and the pages every CP rank holds together
    (``--max-total-tokens`` 4096 per rank; docs/router.md)."""
    reply = asyncio.run(info(nodes[p].address))
    assert (reply.tp_size, reply.pp_size, reply.cp_size) == (tp, pp, cp)
    assert reply.kv_capacity_tokens == 4096 * cp


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory) -> Iterator[tuple[Path, NodeProcess, NodeProcess]]:
    """The model above with a context of 8192 tokens, a CP 2 prefill node and a TP 1 decode node that
    hold a prompt of ``AHEAD_PROMPT_TOKENS``."""
    folder = tmp_path_factory.mktemp("cp_pd_long")
    model = make_tiny_model("llama", folder / "llama", heads=8, kv_heads=4, layers=LAYERS, max_position=8192)
    room = ["--max-total-tokens", "8192", "--chunked-prefill-size", "1024"]
    started = [NodeProcess(role, ["--model", str(model), *(NODE_ARGS if role == "prefill" else DECODE_ARGS), *sizes,
                                  *room], folder / f"{role}.log")
               for role, sizes in (("prefill", ["--cp-size", "2"]), ("decode", []))]
    try:
        prefill, decode = (node.wait_ready() for node in started)
        yield model, prefill, decode
    finally:
        for node in started:
            node.stop()


def test_a_long_prompt_published_ahead_is_handed_over_by_both_ranks(long_pair) -> None:
    """A prompt of ``AHEAD_PROMPT_TOKENS`` reaches the prefill node's rank 1 before rank 0 applies it
    (docs/ranks.md): each rank still builds its handoff from the plan and sends the pages it owns,
    every token's KV once; the answer is the single engine's."""
    model, prefill, decode = long_pair
    prompt = [2 + (i * 7919) % 380 for i in range(AHEAD_PROMPT_TOKENS + 100)]
    tokens, response = asyncio.run(run_pd(prefill.address, decode.address, "ahead", prompt))
    engine = Engine(EngineConfig(model, dtype="float32", page_size=PAGE, max_total_tokens=8192))
    assert tokens == engine.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))[0]
    assert response.transferred_bytes == len(prompt) * TOKEN_BYTES
    wait_for(lambda: idle(prefill.address, decode.address), "every page back on both nodes", 10)
