"""Batched next-token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingBatch:
    """Per-row settings for the rows of a logits matrix.

    ``temperatures[i] == 0`` means greedy; ``top_ks[i] <= 0`` and ``top_ps[i] == 1`` mean no filter.
    A seeded row (``seeds[i]`` not None) draws its noise from a generator seeded by ``(seeds[i],
    positions[i])``, the position of the token it samples in its sequence: the draw depends on
    nothing else, so a seeded request samples the same tokens whatever it is batched with and
    whichever engine samples its next token (the prefill node its first, a decode node the rest, another
    decode node after a migration: docs/migration.md). Unseeded rows share the default
    generator. ``banned[i]``: token ids row i must not
    sample (EOS and stop ids before ``min_tokens``); empty lists, the usual case, cost nothing.
    ``allowed``: int32 bitmask rows [n, words] (bit t % 32 of word t // 32 set: token t may be sampled;
    tokens past the last word may not), on any device; None: every token (docs/structured.md).
    """

    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    seeds: list[int | None]
    positions: list[int]
    banned: list[list[int]] = field(default_factory=list)
    allowed: torch.Tensor | None = None

    @property
    def all_greedy(self) -> bool:
        return all(t == 0 for t in self.temperatures)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Token ids [n] for float32 logits [n, vocab]."""
    logits = _without_banned(apply_allowed(logits, batch.allowed), batch.banned)
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    temps = torch.tensor([t if t > 0 else 1.0 for t in batch.temperatures], device=logits.device)
    probs = _filtered_probs(logits / temps[:, None], batch)
    noise = _exponential_noise(probs, batch.seeds, batch.positions)
    sampled = (probs / noise).argmax(dim=-1)  # exponential race == sampling from probs
    is_greedy = torch.tensor([t == 0 for t in batch.temperatures], device=logits.device)
    return torch.where(is_greedy, greedy, sampled)


def apply_allowed(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """``logits`` with the tokens ``allowed`` does not allow at -inf (a copy; None: ``logits`` itself)."""
    if allowed is None:
        return logits
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (allowed.to(logits.device, non_blocking=True)[:, :, None] >> shifts) & 1
    keep = bits.reshape(allowed.shape[0], -1)[:, :vocab].bool()
    if keep.shape[1] < vocab:
        keep = torch.nn.functional.pad(keep, (0, vocab - keep.shape[1]))
    return logits.masked_fill(~keep, float("-inf"))


def _without_banned(logits: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    cells = [(row, t) for row, ids in enumerate(banned) for t in ids if t < logits.shape[-1]]
    if not cells:
        return logits
    rows, ids = zip(*cells, strict=True)
    out = logits.clone()  # the caller's logits stay raw: logprobs are read from them
    out[list(rows), list(ids)] = float("-inf")
    return out


def _filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_ks = [k if 0 < k < vocab else vocab for k in batch.top_ks]
    if min(top_ks) == vocab and min(batch.top_ps) >= 1.0:
        return logits.softmax(dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= torch.tensor(top_ks, device=logits.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above
    top_ps = torch.tensor(batch.top_ps, device=logits.device)[:, None]
    sorted_probs = sorted_probs.masked_fill(before >= top_ps, 0.0)  # the top token always stays
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def _exponential_noise(probs: torch.Tensor, seeds: list[int | None], positions: list[int]) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for row, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        if seed is not None:
            noise[row].exponential_(generator=position_generator(seed, position, probs.device))
    return noise


def position_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """The generator of a seeded request's draws for the token at ``position`` (every draw that
    decides that token: sampling here, a speculative verification's too)."""
    return torch.Generator(device).manual_seed(position_seed(seed, position))


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a request's draw at ``position``: a hash, so neighbouring (seed,
    position) pairs give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes up to 2^64 - 1; keep it positive
