"""Long prompts under context parallelism, shared by ``tests/test_cp_long.py`` and
``benchmarks/long_context.py``: a tiny Llama with a long rope range, ``tierserve serve --cp-size N``
nodes sized for one long prompt with HiCache and a real ``mooncake_master`` (L3), a streamed
completion that reports its time to first token and where its prompt was served from, and a wait
for a prompt's L3 backups."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from helpers.polling import poll
from helpers.processes import MasterProcess, store_client
from helpers.rank_servers import TPServer, start_server
from helpers.tiny_models import add_word_tokenizer, make_tiny_model
from tierserve.cache.hashing import Namespace, page_keys
from tierserve.cache.options import HostLayout, object_format
from tierserve.cache.sharded.shards import HeadRange, object_key
from tierserve.model.identity import model_identity

PAGE = 16
CHUNK = 4096  # prefill tokens per step: every chunk re-reads the whole prefix, so fewer is faster
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16  # tiny_models' Llama (hidden 64)
TOKEN_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # K and V of one token, float32: 512 B
MAX_POSITION = 131072 + 1024  # 128K-token prompts and their answers
BACKUP_DEADLINE_S = 300.0
REQUEST_TIMEOUT_S = 1800.0  # a 128K-token prefill on two shared cores takes minutes


def long_model(folder: Path, heads: int = HEADS, kv_heads: int = KV_HEADS) -> Path:
    """The tiny Llama of ``tests/helpers/tiny_models.py`` with ``MAX_POSITION`` rope positions (rope_theta
    10000 as every tiny model: the positions, not the frequencies, are what a long prompt tests);
    ``heads`` and ``kv_heads`` of ``HEAD_DIM`` (attention over a long prompt costs in proportion to them)."""
    model = make_tiny_model("llama", folder, max_position=MAX_POSITION, heads=heads, kv_heads=kv_heads, layers=LAYERS)
    return add_word_tokenizer(model)


def l3_flags(master: MasterProcess, rank_tokens: int, host_ratio: float = 2.0) -> list[str]:
    """HiCache (L2 = ``host_ratio`` x L1) and Mooncake L3 for prompts up to about the node's L1:
    ``rank_tokens`` per rank's device pool; a segment that holds a 128K-token prompt (64 MiB) with
    room; ``wait_complete`` prefetches, allowed minutes (the default 30 s cap is for short prompts)."""
    l3 = {"master_server_address": master.address, "global_segment_size": 512 << 20, "local_buffer_size": 64 << 20,
          "prefetch_threshold": 2 * PAGE, "prefetch_timeout_max": 300.0}
    return ["--enable-hierarchical-cache", "--hicache-ratio", str(host_ratio), "--hicache-storage-backend", "mooncake",
            "--hicache-storage-backend-extra-config", json.dumps(l3), "--hicache-storage-prefetch-policy",
            "wait_complete", *node_flags(rank_tokens)]


def node_flags(rank_tokens: int) -> list[str]:
    """Override ``start_server``'s short-prompt settings (argparse keeps the last of a flag)."""
    return ["--page-size", str(PAGE), "--chunked-prefill-size", str(CHUNK), "--max-total-tokens", str(rank_tokens)]


def start_node(model: Path, cp_size: int, log: Path, *flags: str) -> TPServer:
    """``tierserve serve --cp-size N`` with ``flags`` (``l3_flags`` or ``node_flags``), healthy."""
    return start_server(model, 1, log, "--cp-size", str(cp_size), *flags).wait_healthy()


@dataclass(frozen=True)
class Reply:
    """A greedy streamed completion: its token ids, seconds from sending to the first token, and
    the prompt tokens served from each tier (``device``, ``host``, ``storage``)."""

    tokens: list[int]
    ttft_s: float
    tiers: dict[str, int]


def stream(server: TPServer, model: Path, prompt: list[int], max_tokens: int) -> Reply:
    """Sends ``prompt`` (token ids) and reads the stream to its end; EOS ignored."""
    body = {"model": model.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    text, first, usage = "", None, {}
    sent = time.perf_counter()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
        for event in _events(response.raise_for_status()):
            if event.get("choices") and event["choices"][0]["text"]:
                first = first or time.perf_counter()
                text += event["choices"][0]["text"]
            usage = event.get("usage") or usage
    assert first is not None and usage, f"no token or no usage in the stream: {usage}"
    return Reply(_ids(model, text), first - sent, usage["cached_tokens_by_tier"])


def _events(response: httpx.Response):
    """The JSON events of a server-sent event stream, up to ``[DONE]``."""
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def _ids(model: Path, text: str) -> list[int]:
    return Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids


def wait_backed_up(master: MasterProcess, model: Path, tokens: list[int]) -> None:
    """Polls the store until every full page of ``tokens`` is there as a whole-page object (what a
    CP node writes, each page by its owner, and any node reads); backups run after the answer."""
    kv_heads = json.loads((model / "config.json").read_text())["num_key_value_heads"]  # long_model's
    seed = Namespace(model_identity(model), "float32", PAGE, LAYERS, kv_heads, HEAD_DIM,
                     object_format(HostLayout.PAGE_FIRST_DIRECT)).seed()
    keys = page_keys(seed, tokens[: len(tokens) // PAGE * PAGE], PAGE)
    names = [object_key(k, HeadRange(0, kv_heads, kv_heads)) for k in keys]
    with store_client(master) as store:
        poll(lambda: store.batch_exists(names), lambda stored: stored >= len(names),
             f"all {len(names)} pages in L3 (pages stored)", BACKUP_DEADLINE_S, interval_s=0.2)
