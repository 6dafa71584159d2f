"""The decode side of ``--handoff-integrity`` (``transfer/digest.py``): once a reservation's KV
arrived (and left receive staging), every rank digests what its pages hold of the tokens the
prefill node sent, the ranks add their parts up, and the request starts only if every layer's
sum equals the senders'."""

from __future__ import annotations

import functools
from dataclasses import dataclass

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


def received_digests(engine: Engine, request: Request) -> list[int]:
    """This rank's part of the digests of ``request``'s tokens after its cached prefix, per model
    layer (zero for layers of other stages); under context parallelism, of the pages it owns."""
    pages, page_size = local_pages(engine.ranks.cp, request.pages), engine.geometry.page_size
    slots, positions = slots_of(pages, request.num_computed, len(request.prompt_ids), page_size)
    shard, weights = engine.kv_shard, engine_weights(engine)
    heads = (0, shard.heads.count, shard.heads.start)
    own = [layer_digest(engine.pool.buffer[layer], weights, shard.layers.start + layer, slots, positions, heads)
           for layer in range(engine.geometry.num_layers)]
    sums = [0] * engine.model_config.num_layers
    sums[shard.layers.start:shard.layers.start + len(own)] = torch.stack(own).cpu().tolist()  # one device sync
    return sums


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
