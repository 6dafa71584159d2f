"""The decode side of ``--handoff-integrity`` (``transfer/digest.py``): once a reservation's KV
arrived (and left receive staging), every rank digests what its pages hold of the tokens the
prefill node sent, the ranks add their parts up, and the request starts only if every layer's
sum equals the senders'."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tierserve.engine.engine import Engine
from tierserve.engine.request import Request
from tierserve.transfer.digest import MASK, DigestWeights, layer_digest, slots_of
from tierserve.transfer.layout import local_pages


@functools.cache
def _weights(num_kv_heads: int, head_bytes: int, device: torch.device) -> DigestWeights:
    return DigestWeights(num_kv_heads, head_bytes, device)


def engine_weights(engine: Engine) -> DigestWeights:
    g = engine.geometry
    return _weights(engine.model_config.num_kv_heads, g.head_dim * g.dtype.itemsize, engine.device)


def digest_layers(engine: Engine) -> int:
    """How many digests a handoff has: one per target layer, then one per draft layer (packed or
    sidecar; an EAGLE head's feature plane first), the engine's numbering (draft layer i is Lt + i).
    The same on every rank of both nodes, whichever layers a rank holds."""
    return engine.model_config.num_layers + (engine.draft.geometry.num_layers if engine.draft else 0)


@dataclass(frozen=True)
class DigestedPool:
    """A rank's pool whose rows a handoff carries, as the digests count it: ``buffer`` [layers, 2,
    slots, heads, dim], its head 0 the model's (or draft's) head ``head_start``, its layer 0 the
    digests' layer ``first_layer``; ``weights``: the constants of the model it holds the KV of."""

    buffer: torch.Tensor
    weights: DigestWeights
    head_start: int
    first_layer: int

    @property
    def head_bytes(self) -> int:
        return self.weights.words * 4


def target_pool(engine: Engine) -> DigestedPool:
    """The rank's device pool: its heads of its stage's target layers (and a packed draft's, which
    follow the target's last layer, as ``own_layers`` numbers them)."""
    shard = engine.kv_shard
    return DigestedPool(engine.pool.buffer, engine_weights(engine), shard.heads.start, shard.layers.start)


def draft_pool(engine: Engine) -> DigestedPool | None:
    """The rank's sidecar draft pool (None: none here): its draft heads, digested with the draft's
    own constants (its heads and head size) as the digests' layers after the target's."""
    if engine.draft is None or engine.draft_pool is None:
        return None
    g, heads = engine.draft.geometry, engine.draft.heads
    weights = _weights(heads.total, g.head_dim * g.dtype.itemsize, engine.device)
    return DigestedPool(engine.draft_pool.buffer, weights, heads.start, engine.model_config.num_layers)


def received_digests(engine: Engine, request: Request) -> list[int]:
    """This rank's part of the digests of ``request``'s tokens after its cached prefix, per digest
    layer (``digest_layers``; zero for layers it does not hold: other stages', a draft elsewhere);
    under context parallelism, of the pages it owns."""
    pages, page_size = local_pages(engine.ranks.cp, request.pages), engine.geometry.page_size
    slots, positions = slots_of(pages, request.num_computed, len(request.prompt_ids), page_size)
    held = [p for p in (target_pool(engine), draft_pool(engine)) if p is not None]
    own = [_pool_digests(p, slots, positions) for p in held]
    values, sums = iter(torch.cat(own).cpu().tolist()), [0] * digest_layers(engine)  # one device sync
    for pool in held:
        for layer in range(pool.buffer.shape[0]):
            sums[pool.first_layer + layer] = next(values)
    return sums


def _pool_digests(pool: DigestedPool, slots: np.ndarray, positions: np.ndarray) -> torch.Tensor:
    """Per layer of ``pool``, the digest of every head it holds at ``slots``."""
    heads = (0, pool.buffer.shape[3], pool.head_start)
    return torch.stack([layer_digest(pool.buffer[layer], pool.weights, pool.first_layer + layer, slots, positions,
                                     heads) for layer in range(pool.buffer.shape[0])])


def _node_sums(engine: Engine, local: list[int]) -> list[int]:
    """Every rank's parts added up (one collective on the control group at several ranks)."""
    if engine.ranks.size == 1:
        return [v & MASK for v in local]
    every: list[list[int] | None] = [None] * engine.ranks.size
    dist.all_gather_object(every, local, group=engine.ranks.control)
    return [sum(column) & MASK for column in zip(*every, strict=True)]


@dataclass(frozen=True)
class ReceiveCheck:
    """The senders' digests of a request (per model layer); called by ``Engine.start_reserved`` on
    every rank, it answers None when the KV matches, else what did not (the request then fails)."""

    expected: tuple[int, ...]

    def __call__(self, engine: Engine, request: Request) -> str | None:
        got = _node_sums(engine, received_digests(engine, request))
        if len(got) != len(self.expected):
            return f"the prefill node sent {len(self.expected)} layer digests for {len(got)} layers"
        bad = [layer for layer, (a, b) in enumerate(zip(got, self.expected, strict=True)) if a != b]
        return f"KV handed over does not match its digest in layers {bad[:8]}" if bad else None


@dataclass(frozen=True)
class ScatterFence:
    """A take of a staged reservation on a decode node of several ranks: the ranks meet (one
    collective) once each scattered its staging into its pages, so rank 0 applies no later command
    before every rank did.

    Why: rank 0 applies a command (and answers a ``Reserve``) before the other ranks, which apply it
    with the next step's message. Its take frees the region, so a ``Reserve`` it applies next may be
    given the same bytes of every rank's staging arena, and that reservation's prefill node may write
    there while another rank (a PP stage, frozen or only slow) has yet to scatter the first
    request's KV out of them: that rank's layers of some of its tokens were the second prompt's
    (issue 31's wrong outputs on a TP 2 prefill -> PP 2 decode cluster; ``--handoff-integrity``'s
    check, a collective at the same point, hid them). Checks nothing: always None."""

    def __call__(self, engine: Engine, request: Request) -> str | None:
        dist.barrier(group=engine.ranks.control)
        return None
