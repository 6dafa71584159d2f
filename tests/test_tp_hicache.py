"""HiCache on every rank of ``tierserve serve --tp-size N`` through the OpenAI API, with a real
``mooncake_master``: at TP=2, answers served from L1, L2 and L3 equal ``transformers``' (no cache);
L3 pages written at one TP size are read at another (TP 2 -> 1 and 4, TP 1 and 4 -> 2), at least
90% of the prompt from storage, with the same answer, also from the finer objects a writer told the
cluster's TP sizes stores; a rank whose store shows fewer pages shortens the node's L3 hit."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers.processes import MasterProcess
from helpers.rank_servers import NEW_TOKENS, TPServer, hf_greedy, start_server
from helpers.tiny_models import add_word_tokenizer, make_tiny_model
from tokenizers import Tokenizer

from tierserve.cache.hashing import Namespace, page_keys
from tierserve.cache.options import HostLayout, object_format
from tierserve.cache.sharded.shards import HeadRange, object_key
from tierserve.cache.storage.mooncake import MooncakeStorage
from tierserve.model.identity import model_identity

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PAGE = 4  # tp_server's page size
KV_HEADS = 4  # TP 1, 2 and 4 hold 4, 2 and 1 of them
PROMPT_TOKENS = 70
BACKUP_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    model = make_tiny_model("llama", tmp_path_factory.mktemp("llama"), heads=8, kv_heads=KV_HEADS)
    return add_word_tokenizer(model)


@pytest.fixture(scope="module")
def asked() -> list[list[int]]:
    """Eight distinct prompts of ``PROMPT_TOKENS`` (17 full pages), one per use below."""
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(2, 384, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(8)]


@pytest.fixture(scope="module")
def expected(model: Path, asked: list[list[int]]) -> list[list[int]]:
    return hf_greedy(model, asked)



def hicache_flags(master: MasterProcess, max_tokens: int = 2048, faults: dict | None = None,
                  tp_sizes: list[int] | None = None) -> list[str]:
    l3 = {"master_server_address": master.address, "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20,
          "prefetch_threshold": 2 * PAGE, "fault_injection": faults, "l3_tp_sizes": tp_sizes}
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
            "--hicache-storage-backend-extra-config", json.dumps(l3), "--hicache-storage-prefetch-policy",
            "wait_complete", "--max-total-tokens", str(max_tokens)]


def serve(model: Path, tp_size: int, log: Path, master: MasterProcess, max_tokens: int = 2048,
          faults: dict | None = None, tp_sizes: list[int] | None = None) -> TPServer:
    flags = hicache_flags(master, max_tokens, faults, tp_sizes)
    return start_server(model, tp_size, log, *flags).wait_healthy()


def complete(server: TPServer, model: Path, prompt: list[int]) -> tuple[list[int], dict[str, int]]:
    """Greedy answer as token ids, and the prompt's cached tokens by tier."""
    body = {"model": model.name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).raise_for_status().json()
    words = Tokenizer.from_file(str(model / "tokenizer.json"))
    return words.encode(reply["choices"][0]["text"]).ids, reply["usage"]["cached_tokens_by_tier"]


def seed(model: Path, kv_heads: int = KV_HEADS) -> bytes:
    """The namespace seed every node of this model uses, whatever its TP size."""
    return Namespace(model_identity(model), "float32", PAGE, 2, kv_heads, 16,
                     object_format(HostLayout.PAGE_FIRST_DIRECT)).seed()


def wait_backed_up(master: MasterProcess, model: Path, tokens: list[int], tp_size: int) -> None:
    """Polls the store until every object a ``tp_size`` node writes for the prompt's full pages
    is there (backups run in the background after the answer)."""
    keys = page_keys(seed(model), tokens[: len(tokens) // PAGE * PAGE], PAGE)
    count = max(1, KV_HEADS // tp_size)
    wait_in_l3(master, [object_key(k, HeadRange(h, count, KV_HEADS)) for k in keys for h in range(0, KV_HEADS, count)])


def wait_in_l3(master: MasterProcess, names: list[bytes]) -> None:
    """Polls the store until it holds every object of ``names``."""
    store = MooncakeStorage(master.address, global_segment_size=0, local_buffer_size=16 << 20)
    try:
        deadline = time.monotonic() + BACKUP_DEADLINE_S
        while store.batch_exists(names) < len(names):
            assert time.monotonic() < deadline, f"backups not in L3 after {BACKUP_DEADLINE_S} s"
            time.sleep(0.1)  # poll interval
    finally:
        store.close()


def test_tp2_answers_from_l1_l2_and_l3_equal_no_cache(model, asked, expected, master, tmp_path: Path) -> None:
    # 48 device pages: three other prompts (22 pages each) push the first out of L1 into L2 only
    writer = serve(model, 2, tmp_path / "writer.log", master, max_tokens=48 * PAGE)
    try:
        assert complete(writer, model, asked[0]) == (expected[0], {"device": 0, "host": 0, "storage": 0})
        answer, tiers = complete(writer, model, asked[0])
        assert answer == expected[0] and tiers["device"] >= 16 * PAGE, tiers
        for i in (1, 2, 3):
            assert complete(writer, model, asked[i])[0] == expected[i]
        answer, tiers = complete(writer, model, asked[0])
        assert answer == expected[0] and tiers["host"] > 0, tiers
        wait_backed_up(master, model, asked[1], 2)
        reader = serve(model, 2, tmp_path / "reader.log", master)
        try:
            answer, tiers = complete(reader, model, asked[1])
        finally:
            reader.stop()
        assert answer == expected[1] and tiers["storage"] >= 0.9 * PROMPT_TOKENS, tiers
    finally:
        writer.stop()


@pytest.mark.parametrize(("writer_tp", "reader_tps"), [(2, (1, 4)), (1, (2,)), (4, (2,))])
def test_l3_pages_are_read_across_tp_sizes(model, asked, expected, master, tmp_path: Path, writer_tp: int,
                                           reader_tps: tuple[int, ...]) -> None:
    prompt = {2: 4, 1: 5, 4: 6}[writer_tp]  # a prompt of its own: no other test's pages can serve it
    writer = serve(model, writer_tp, tmp_path / "writer.log", master)
    try:
        assert complete(writer, model, asked[prompt])[0] == expected[prompt]
        wait_backed_up(master, model, asked[prompt], writer_tp)
        for tp in reader_tps:
            reader = serve(model, tp, tmp_path / f"reader-{tp}.log", master)
            try:
                answer, tiers = complete(reader, model, asked[prompt])
            finally:
                reader.stop()
            assert answer == expected[prompt], (writer_tp, tp)
            assert tiers["storage"] >= 0.9 * PROMPT_TOKENS, (writer_tp, tp, tiers)
    finally:
        writer.stop()


def test_a_tp1_writer_told_the_cluster_tp_sizes_stores_halves_that_tp2_ranks_read(model, asked, expected, master,
                                                                                    tmp_path: Path) -> None:
    """A TP=1 node with ``l3_tp_sizes`` [1, 2] stores every page whole and in halves; with the
    whole objects removed, a TP=2 node still takes the prompt from L3, from the halves alone."""
    writer = serve(model, 1, tmp_path / "writer.log", master, tp_sizes=[1, 2])
    try:
        assert complete(writer, model, asked[3])[0] == expected[3]
        keys = page_keys(seed(model), asked[3][: PROMPT_TOKENS // PAGE * PAGE], PAGE)
        wait_in_l3(master, keys + [object_key(k, HeadRange(h, 2, KV_HEADS)) for k in keys for h in (0, 2)])
        remove_from_l3(master, keys)
        reader = serve(model, 2, tmp_path / "reader.log", master)
        try:
            answer, tiers = complete(reader, model, asked[3])
        finally:
            reader.stop()
        assert answer == expected[3] and tiers["storage"] >= 0.9 * PROMPT_TOKENS, tiers
    finally:
        writer.stop()


def remove_from_l3(master: MasterProcess, names: list[bytes]) -> None:
    """Removes objects (the backend has no such call: a cache never removes one page)."""
    store = MooncakeStorage(master.address, global_segment_size=0, local_buffer_size=16 << 20)
    try:
        codes = store._call(lambda s: s.batch_remove([store.prefix + k.hex() for k in names], True))
        assert all(c == 0 for c in codes), codes
        assert store.exists_each(names) == [False] * len(names)
    finally:
        store.close()


def test_a_rank_that_sees_fewer_l3_pages_shortens_the_hit_of_the_node(model, asked, expected, master,
                                                                      tmp_path: Path) -> None:
    """Rank 1's store shows 6 pages (test fault, its process only): the node takes 6 pages from L3
    on both ranks and computes the rest, with the answer of no cache."""
    writer = serve(model, 2, tmp_path / "writer.log", master)
    try:
        assert complete(writer, model, asked[7])[0] == expected[7]
        wait_backed_up(master, model, asked[7], 2)
        reader = serve(model, 2, tmp_path / "reader.log", master, faults={"ranks": [1], "exists_cap": 6})
        try:
            answer, tiers = complete(reader, model, asked[7])
            again = complete(reader, model, asked[7])[0]  # its tree is whole on both ranks
        finally:
            reader.stop()
        assert answer == again == expected[7] and tiers["storage"] == 6 * PAGE, tiers
    finally:
        writer.stop()


def test_replicated_kv_heads_are_written_once_and_read_at_tp1(master, tmp_path: Path) -> None:
    """Qwen3 with 2 KV heads at TP=4: ranks 0 and 2 write heads 0 and 1 (their neighbours replicate
    them and write nothing); a TP=1 node reads both objects of every page."""
    qwen3 = add_word_tokenizer(make_tiny_model("qwen3", tmp_path / "qwen3", heads=8, kv_heads=2))
    prompt = torch.randint(2, 384, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(12)).tolist()
    expected = hf_greedy(qwen3, [prompt])[0]
    writer = serve(qwen3, 4, tmp_path / "writer.log", master)
    try:
        assert complete(writer, qwen3, prompt)[0] == expected
        keys = page_keys(seed(qwen3, 2), prompt[: PROMPT_TOKENS // PAGE * PAGE], PAGE)
        wait_in_l3(master, [object_key(k, HeadRange(h, 1, 2)) for k in keys for h in (0, 1)])
        reader = serve(qwen3, 1, tmp_path / "reader.log", master)
        try:
            answer, tiers = complete(reader, qwen3, prompt)
        finally:
            reader.stop()
        assert answer == expected and tiers["storage"] >= 0.9 * PROMPT_TOKENS, tiers
    finally:
        writer.stop()
