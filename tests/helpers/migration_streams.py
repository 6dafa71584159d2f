"""Streams through the router that record each token's arrival, and a cluster whose decode nodes
back their KV up into a prefill node's L3 segment (a decode node that dies takes nothing of L3
with it): the pieces of the migration tests and ``benchmarks/migration.py``."""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PAGE = 16
ARGS = ["--device", "cpu", "--dtype", "float32", "--page-size", str(PAGE), "--chunked-prefill-size", "256",
        "--max-total-tokens", "16384", "--enable-hierarchical-cache"]


def l3_args(master: str, segment_bytes: int, policy: str = "wait_complete") -> list[str]:
    """L3 on the Mooncake master at ``master``; ``segment_bytes`` 0: a store client only (decode
    nodes here), so what it backs up lives in other nodes' segments and survives it."""
    config = {"master_server_address": master, "global_segment_size": segment_bytes, "local_buffer_size": 16 << 20,
              "prefetch_threshold": 2 * PAGE}
    return ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", json.dumps(config),
            "--hicache-storage-prefetch-policy", policy]


@dataclass
class Stream:
    """One completion through the router: its text pieces with their arrival times, its end."""

    body: dict
    id: str = ""  # the completion's, as the stream's events name it
    pieces: list[tuple[float, str]] = field(default_factory=list)
    status: int = 0
    finish_reason: str | None = None
    errors: list[dict] = field(default_factory=list)
    usage: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(p for _, p in self.pieces)

    @property
    def tokens(self) -> list[int]:
        """The word tokenizer's text (" w12 w7 ...") as token ids."""
        return [int(w[1:]) for w in self.text.split()]

    def longest_gap(self) -> float:
        """The longest wait between two pieces (the first piece's wait is the TTFT, not a gap)."""
        times = [t for t, _ in self.pieces]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def run(url: str, stream: Stream) -> Stream:
    """Sends ``stream.body`` (streaming or not) and records what comes back."""
    if not stream.body.get("stream"):
        reply = httpx.post(f"{url}/v1/completions", json=stream.body, timeout=300)
        stream.status = reply.status_code
        if reply.status_code == 200:
            answer = reply.json()
            stream.pieces.append((time.monotonic(), answer["choices"][0]["text"]))
            stream.finish_reason, stream.usage = answer["choices"][0]["finish_reason"], answer["usage"]
        return stream
    with httpx.stream("POST", f"{url}/v1/completions", json=stream.body, timeout=300) as reply:
        stream.status = reply.status_code
        for line in reply.iter_lines():
            _event(stream, line.removeprefix("data: ") if line.startswith("data: ") else None)
    return stream


def _event(stream: Stream, data: str | None) -> None:
    if data is None or data == "[DONE]":
        return
    event = json.loads(data)
    if "error" in event:
        stream.errors.append(event["error"])
        return
    stream.id = event.get("id", stream.id)
    for choice in event.get("choices", []):
        if choice.get("text"):
            stream.pieces.append((time.monotonic(), choice["text"]))
        stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
    stream.usage = event.get("usage") or stream.usage


def start_all(url: str, streams: list[Stream]) -> list[threading.Thread]:
    threads = [threading.Thread(target=run, args=(url, s), daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    return threads


def wait_streaming(streams: list[Stream], words: int, deadline_s: float = 120.0) -> None:
    """Polls until every streaming request received at least ``words`` tokens."""
    deadline = time.monotonic() + deadline_s
    while any(len(s.text.split()) < words for s in streams if s.body.get("stream")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the streams did not reach {words} tokens in {deadline_s} s")
        time.sleep(0.01)  # poll interval


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, 384) for _ in range(length)] for _ in range(n)]


def model_with_words(out: Path) -> Path:
    """A tiny llama (2048 positions) whose token i reads " w<i>", so text gives the token ids back;
    its byte-level vocabulary takes grammars (``WORD_REGEX``)."""
    from helpers.tiny_models import add_word_tokenizer, make_tiny_model

    return add_word_tokenizer(make_tiny_model("llama", out, max_position=2048), byte_level=True)
