"""HiCache with a real ``mooncake_master`` on a multi-rank ``tierserve serve`` node (TP, CP or PP
ranks of ``rank_servers``): the flags, a greedy completion with its cached tiers, the namespace seed
every node of a model shares, and waits for (and removals of) the objects a node backs up to L3."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from helpers.polling import wait_for
from helpers.processes import MasterProcess, store_client
from helpers.rank_servers import NEW_TOKENS, TPServer
from tierserve.cache.hashing import Namespace, page_keys
from tierserve.cache.options import HostLayout, object_format
from tierserve.cache.sharded.shards import HeadRange, object_key
from tierserve.model.identity import model_identity

PAGE = 4  # rank_servers' page size
KV_HEADS = 4  # the tests' models: TP 1, 2 and 4 hold 4, 2 and 1 of them
BACKUP_DEADLINE_S = 60.0


def hicache_flags(master: MasterProcess, max_tokens: int = 2048, tp_sizes: list[int] | None = None) -> list[str]:
    """HiCache with L3 on ``master`` (prefetch from two pages on, waited for), a device pool of
    ``max_tokens`` per rank and the cluster's TP sizes for finer objects (test faults are no flag:
    ``helpers.injected_faults``)."""
    l3 = {"master_server_address": master.address, "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20,
          "prefetch_threshold": 2 * PAGE, "l3_tp_sizes": tp_sizes}
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
            "--hicache-storage-backend-extra-config", json.dumps(l3), "--hicache-storage-prefetch-policy",
            "wait_complete", "--max-total-tokens", str(max_tokens)]


def complete(server: TPServer, model: Path, prompt: list[int]) -> tuple[list[int], dict[str, int]]:
    """Greedy answer as token ids, and the prompt's cached tokens by tier."""
    body = {"model": model.name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).raise_for_status().json()
    words = Tokenizer.from_file(str(model / "tokenizer.json"))
    return words.encode(reply["choices"][0]["text"]).ids, reply["usage"]["cached_tokens_by_tier"]


def seed(model: Path, kv_heads: int = KV_HEADS) -> bytes:
    """The namespace seed every node of this (2-layer) model uses, whatever its TP size."""
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
    with store_client(master) as store:
        wait_for(lambda: store.batch_exists(names) >= len(names), f"backups in L3 after {BACKUP_DEADLINE_S} s",
                 BACKUP_DEADLINE_S, interval_s=0.1)


def remove_from_l3(master: MasterProcess, names: list[bytes]) -> None:
    """Removes objects (the backend has no such call: a cache never removes one page)."""
    with store_client(master) as store:
        codes = store._call(lambda s: s.batch_remove([store.prefix + k.hex() for k in names], True))
        assert all(c == 0 for c in codes), codes
        assert store.exists_each(names) == [False] * len(names)


def assert_hits_l1_then_l2(server: TPServer, model: Path, asked: list[list[int]], expected: list[list[int]]) -> None:
    """``asked[0]`` answers as ``expected[0]`` cold (nothing cached), then from L1 (16 pages or more);
    three other prompts (``asked[1:4]``, each its answer) push it out of a 48-page L1, and it
    answers again from L2."""
    assert complete(server, model, asked[0]) == (expected[0], {"device": 0, "host": 0, "storage": 0})
    answer, tiers = complete(server, model, asked[0])
    assert answer == expected[0] and tiers["device"] >= 16 * PAGE, tiers
    for i in (1, 2, 3):
        assert complete(server, model, asked[i])[0] == expected[i]
    answer, tiers = complete(server, model, asked[0])
    assert answer == expected[0] and tiers["host"] > 0, tiers
