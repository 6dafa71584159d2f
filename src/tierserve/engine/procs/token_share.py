"""Every rank appends the same sampled tokens: one rank alone (``Ranks.sampler``: rank 0, or with
pipeline stages tensor rank 0 of the last one) computes logits and samples, then broadcasts the
tokens with a digest of the batch it ran (``docs/ranks.md``)."""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from tierserve.engine.procs.ranks import Ranks
from tierserve.engine.scheduler import Scheduled


class RankDivergenceError(RuntimeError):
    """A rank scheduled another batch than rank 0: its tree or page tables differ. Fatal for the node."""


class TokenShare(Protocol):
    """``share(batch, count, sample)``: the ``count`` tokens of this step; ``sample()`` computes them
    where this rank samples."""

    def share(self, batch: Sequence[Scheduled], count: int, sample: Callable[[], list[int]]) -> list[int]: ...


class SoleSampler:
    """One rank: it samples, nothing crosses processes."""

    def share(self, batch: Sequence[Scheduled], count: int, sample: Callable[[], list[int]]) -> list[int]:
        return sample()


@dataclass(frozen=True)
class LeaderSampler:
    """The sampling rank of several: samples and broadcasts ``[digest, tokens...]``, every step (an
    empty one still checks the digest)."""

    ranks: Ranks

    def share(self, batch: Sequence[Scheduled], count: int, sample: Callable[[], list[int]]) -> list[int]:
        tokens = sample()
        message = torch.tensor([batch_digest(batch), *tokens], dtype=torch.int64)
        dist.broadcast(message, src=self.ranks.sampler, group=self.ranks.control)
        return tokens


@dataclass(frozen=True)
class FollowerSampler:
    """The other ranks: take the sampler's tokens, after checking that it ran the batch this rank ran."""

    ranks: Ranks

    def share(self, batch: Sequence[Scheduled], count: int, sample: Callable[[], list[int]]) -> list[int]:
        message = torch.empty(count + 1, dtype=torch.int64)
        dist.broadcast(message, src=self.ranks.sampler, group=self.ranks.control)
        if int(message[0]) != batch_digest(batch):
            raise RankDivergenceError(f"rank {self.ranks.rank} scheduled another batch than rank {self.ranks.sampler}")
        return message[1:].tolist()


def token_share(ranks: Ranks) -> TokenShare:
    """The sampler of this rank's place in its node."""
    if ranks.size == 1:
        return SoleSampler()
    return LeaderSampler(ranks) if ranks.rank == ranks.sampler else FollowerSampler(ranks)


def batch_digest(batch: Sequence[Scheduled]) -> int:
    """A CRC of what each request computes this step and where its KV lives: equal on every rank
    that is in step (request ids are broadcast, so they match too)."""
    crc = 0
    for s in batch:
        r = s.request
        crc = zlib.crc32(r.request_id.encode(), crc)
        crc = zlib.crc32(array("q", [r.num_computed, s.num_tokens, *r.pages]).tobytes(), crc)
    return crc
