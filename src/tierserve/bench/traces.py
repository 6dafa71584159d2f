"""Replays of public serving traces (the ``traces/`` folder of the shared project data, beside
the checkout) as token-id workloads.

Mooncake format: every ``hash_id`` names one block of the trace's block size (512 tokens) and the
whole prefix before it. The replay draws one deterministic block of ``block_size`` token ids per
hash id (its first two ids encode the hash id, so different ids never give equal blocks), so two
records that share their first k ids get prompts that share exactly their first k blocks, and no
more: the trace's sharing structure at a smaller scale. The last block is cut in proportion to the
trace's partial last block; output lengths scale by ``output_scale`` (default: the same ratio).

Azure format: lengths and arrival times only, fresh random ids per request (no reuse: a control).
Arrival offsets are the trace's seconds from its first record; the runner scales them."""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tierserve.bench.records import RequestSpec
from tierserve.bench.tokens import TokenSpace
from tierserve.bench.workloads import OneShot, Session, Workload

MOONCAKE_BLOCK = 512


@dataclass
class TraceConfig:
    """Which records to replay and at what scale. ``max_prompt_tokens`` cuts longer prompts (after
    scaling) at a block boundary where it can, so they still fit the model's context."""

    path: Path
    block_size: int = 16
    output_scale: float | None = None  # None: block_size / 512, like the prompts
    max_records: int | None = None
    max_prompt_tokens: int | None = None
    min_output_tokens: int = 1

    @property
    def scale(self) -> float:
        return self.block_size / MOONCAKE_BLOCK

    def output_tokens(self, n: int) -> int:
        factor = self.scale if self.output_scale is None else self.output_scale
        return max(self.min_output_tokens, round(n * factor))


class BlockBank:
    """One deterministic block of token ids per hash id, drawn on first use."""

    def __init__(self, space: TokenSpace, block_size: int, seed: int) -> None:
        if block_size < 2:
            raise ValueError("block_size must be at least 2 (two ids name the block)")
        self.space, self.block_size, self.seed = space, block_size, seed
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        found = self._blocks.get(hash_id)
        if found is None:
            rng = random.Random(f"{self.seed}:block:{hash_id}")
            found = self._blocks[hash_id] = self.space.tagged_ids(hash_id, rng, self.block_size)
        return found


def mooncake_prompt(record: dict[str, Any], bank: BlockBank, max_tokens: int | None = None) -> list[int]:
    """The token ids of one Mooncake record: full blocks for all hash ids but the last, and the
    last block cut to the scaled length of the trace's partial last block (at least one token)."""
    ids: list[int] = record["hash_ids"]
    if not ids:
        return []
    bs = bank.block_size
    last_len = record["input_length"] - MOONCAKE_BLOCK * (len(ids) - 1)
    last = min(bs, max(1, math.ceil(last_len * bs / MOONCAKE_BLOCK)))
    prompt = [t for h in ids[:-1] for t in bank.block(h)] + bank.block(ids[-1])[:last]
    return prompt if max_tokens is None else prompt[:max_tokens]


def read_mooncake(path: Path, limit: int | None = None) -> Iterator[dict[str, Any]]:
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            if line.strip():
                yield json.loads(line)


def mooncake_trace(config: TraceConfig, space: TokenSpace | None = None, seed: int = 0) -> Workload:
    """A Mooncake-format trace as one-request sessions with the trace's arrival times."""
    bank = BlockBank(space or TokenSpace(), config.block_size, seed)
    sessions: list[Session] = []
    t0: float | None = None
    for i, record in enumerate(read_mooncake(config.path, config.max_records)):
        t0 = record["timestamp"] if t0 is None else t0
        prompt = mooncake_prompt(record, bank, config.max_prompt_tokens)
        tags = {"record": i, "blocks": len(record["hash_ids"])}
        spec = RequestSpec(prompt, config.output_tokens(record["output_length"]), tags)
        sessions.append(OneShot(spec, arrival=(record["timestamp"] - t0) / 1000))
    return Workload("trace", _params(config, bank.space, seed), sessions)


def azure_trace(config: TraceConfig, space: TokenSpace | None = None, seed: int = 0) -> Workload:
    """An Azure-format CSV (TIMESTAMP, ContextTokens, GeneratedTokens): lengths scaled like the
    Mooncake replay (``block_size`` / 512) and arrival times, fresh random ids per request."""
    space = space or TokenSpace()
    sessions: list[Session] = []
    with open(config.path, newline="") as f:
        t0: datetime | None = None
        for i, row in enumerate(csv.DictReader(f)):
            if config.max_records is not None and i >= config.max_records:
                break
            stamp = datetime.fromisoformat(row["TIMESTAMP"])
            t0 = stamp if t0 is None else t0
            length = max(1, round(int(row["ContextTokens"]) * config.scale))
            if config.max_prompt_tokens is not None:
                length = min(length, config.max_prompt_tokens)
            prompt = space.random_ids(random.Random(f"{seed}:azure:{i}"), length)
            spec = RequestSpec(prompt, config.output_tokens(int(row["GeneratedTokens"])), {"record": i})
            sessions.append(OneShot(spec, arrival=(stamp - t0).total_seconds()))
    return Workload("azure", _params(config, space, seed), sessions)


def _params(config: TraceConfig, space: TokenSpace, seed: int) -> dict[str, Any]:
    return {**config.__dict__, "path": str(config.path), "vocab_size": space.vocab_size, "min_id": space.min_id,
            "seed": seed}
