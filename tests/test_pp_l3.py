"""L3 with pipeline stages through ``tierserve serve --pp-size 2`` and a real ``mooncake_master``:
each stage backs up and reads its own layers of every page (objects named by layer range), answers
served from L3 at PP 2 equal ``transformers``' (no cache), and a prompt written by a PP=2 node is
served at least 90% from L3 by a PP=1 node, and the reverse, with the same answer."""

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
from tierserve.cache.sharded.shards import HeadRange, LayerRange, object_key
from tierserve.cache.storage.mooncake import MooncakeStorage
from tierserve.model.identity import model_identity

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PAGE = 4  # tp_server's page size
KV_HEADS = 4
LAYERS = 4  # two per stage at PP 2
PROMPT_TOKENS = 70  # 17 full pages
BACKUP_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    model = make_tiny_model("llama", tmp_path_factory.mktemp("llama"), heads=8, kv_heads=KV_HEADS, layers=LAYERS)
    return add_word_tokenizer(model)


@pytest.fixture(scope="module")
def asked() -> list[list[int]]:
    gen = torch.Generator().manual_seed(21)
    return [torch.randint(2, 384, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(2)]


@pytest.fixture(scope="module")
def expected(model: Path, asked: list[list[int]]) -> list[list[int]]:
    return hf_greedy(model, asked)



def serve(model: Path, pp_size: int, log: Path, master: MasterProcess) -> TPServer:
    l3 = {"master_server_address": master.address, "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20,
          "prefetch_threshold": 2 * PAGE}
    flags = ["--pp-size", str(pp_size), "--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
             "--hicache-storage-backend-extra-config", json.dumps(l3), "--hicache-storage-prefetch-policy",
             "wait_complete"]
    return start_server(model, 1, log, *flags).wait_healthy()


def complete(server: TPServer, model: Path, prompt: list[int]) -> tuple[list[int], dict[str, int]]:
    """Greedy answer as token ids, and the prompt's cached tokens by tier."""
    body = {"model": model.name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).raise_for_status().json()
    words = Tokenizer.from_file(str(model / "tokenizer.json"))
    return words.encode(reply["choices"][0]["text"]).ids, reply["usage"]["cached_tokens_by_tier"]


def object_names(model: Path, tokens: list[int], pp_size: int) -> list[bytes]:
    """Every object a TP=1 node of ``pp_size`` stages writes for the prompt's full pages."""
    seed = Namespace(model_identity(model), "float32", PAGE, LAYERS, KV_HEADS, 16,
                     object_format(HostLayout.PAGE_FIRST_DIRECT)).seed()
    keys = page_keys(seed, tokens[: len(tokens) // PAGE * PAGE], PAGE)
    per = LAYERS // pp_size
    ranges = [LayerRange(s * per, per, LAYERS) for s in range(pp_size)]
    return [object_key(k, HeadRange(0, KV_HEADS, KV_HEADS), r) for k in keys for r in ranges]


def wait_in_l3(master: MasterProcess, names: list[bytes]) -> None:
    """Polls the store until it holds every object of ``names`` (backups run after the answer)."""
    store = MooncakeStorage(master.address, global_segment_size=0, local_buffer_size=16 << 20)
    try:
        deadline = time.monotonic() + BACKUP_DEADLINE_S
        while store.batch_exists(names) < len(names):
            assert time.monotonic() < deadline, f"backups not in L3 after {BACKUP_DEADLINE_S} s"
            time.sleep(0.1)  # poll interval
    finally:
        store.close()


def read_back(model: Path, master: MasterProcess, prompt: list[int], pp_size: int, log: Path) -> tuple[list, dict]:
    """The answer and cached tiers of ``prompt`` on a fresh node of ``pp_size`` stages."""
    reader = serve(model, pp_size, log, master)
    try:
        return complete(reader, model, prompt)
    finally:
        reader.stop()


@pytest.mark.parametrize(("writer_pp", "reader_pps"), [(2, (2, 1)), (1, (2,))])
def test_l3_pages_are_read_across_pp_sizes(model, asked, expected, master, tmp_path: Path, writer_pp: int,
                                           reader_pps: tuple[int, ...]) -> None:
    """Each stage writes its layers' object of every page; a PP=2 node reads them with answers equal
    to no cache, a PP=1 node reads both stages' objects of a page, and a PP=2 node reads each
    stage's layers out of a PP=1 node's whole pages."""
    prompt = {2: 0, 1: 1}[writer_pp]  # a prompt of its own: no other case's pages can serve it
    writer = serve(model, writer_pp, tmp_path / "writer.log", master)
    try:  # the writer stays up: its Mooncake segment holds the objects
        assert complete(writer, model, asked[prompt]) == (expected[prompt], {"device": 0, "host": 0, "storage": 0})
        wait_in_l3(master, object_names(model, asked[prompt], writer_pp))
        for pp in reader_pps:
            answer, tiers = read_back(model, master, asked[prompt], pp, tmp_path / f"reader-{pp}.log")
            assert answer == expected[prompt], (writer_pp, pp)
            assert tiers["storage"] >= 0.9 * PROMPT_TOKENS, (writer_pp, pp, tiers)
    finally:
        writer.stop()
