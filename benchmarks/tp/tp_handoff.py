"""Item 3: KV handoff between TP sizes against the raw transfer engine writing the same bytes.

Real decode nodes at TP=1 and TP=2 (``tierserve decode --tp-size N``, each rank its own transfer
engine and KV arena) reserve pages for a ``tokens``-token prompt. This process plays the prefill
ranks as a prefill node's would be set up (``RankTransfer.handoff``): per rank an arena holding
its KV heads, registered with its own ``PeerEngines``, the routes ``plan_routes`` gives its heads
to the destination's ranks (``destination_ranks`` of the Reserve answer), and a ``KVHandoff``
driven as the engine drives it with the KV in place: ``on_layer`` for every layer on every rank,
then ``result()``; timed from construction to the last rank's result. The ranks of one prefill
node run in this one process (their sender threads share the interpreter), not in processes of
their own as in a node. Measured side by side, in rotating order each round:

- ``P1->D1``, ``P2->D1``, ``P1->D2``, ``P2->D2``: the handoffs;
- ``raw->D1``, ``raw->D2``: the same number of bytes as one block in one synchronous write of one
  transfer engine into the decode node's rank 0 arena (the engine's best case, as
  ``benchmarks/transfer.py``'s ``raw``);
- ``raw blocks->D1``: the same bytes in blocks of a mixed handoff's size and count (one head
  sub-range of one token's K or V each), on the raw engine handle with the handoff's batch and
  in-flight limits: what the transfer engine itself charges for that many entries.

Ratio: raw time / handoff time for the same destination node (the handoff's share of raw
bandwidth, target >= 0.8). Then, for context, the real path (``--rpc-repeats``): prefill nodes at
TP=1 and TP=2 and a Prefill RPC per pairing (compute and handoff overlapped), its
``transfer_seconds`` and ``exposed_transfer_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from tp_common import NODE_FLAGS, PAGE, ModelShape, NodeProcess, median, median_ratio, prompt, rotated

from tierserve.core.transfer import TransferProtocol
from tierserve.node.convert import destination_ranks
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.router import pd_flow
from tierserve.transfer.engine import MAX_INFLIGHT_ENTRIES, PeerEngines, TransferEngineHandle
from tierserve.transfer.handoff import MAX_BATCH_ENTRIES, KVHandoff
from tierserve.transfer.layout import Block, HeadRange, KVArena, plan_routes, route_blocks, token_runs
from tierserve.transfer.staging import Gatherer, StagingArena, gathers

LEASE_S = 600.0  # the reservations outlive every round
SOURCE_SLOTS = 4096
STAGING_BYTES = 64 << 20  # a prefill rank's default (--handoff-staging-mb)
PAIRINGS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@dataclass
class SourceRank:
    """One prefill rank: its KV heads' arena, its staging (as a prefill node's: 64 MiB) and its
    transfer engines."""

    buffer: torch.Tensor
    peers: PeerEngines
    arena: KVArena
    held: HeadRange
    gatherer: Gatherer


def node_args(model: Path, tp: int) -> list[str]:
    return ["--model", str(model), *NODE_FLAGS, "--max-total-tokens", "8192", "--disable-radix-cache",
            "--tp-size", str(tp), "--log-level", "warning"]


def source_ranks(shape: ModelShape, tp: int) -> list[SourceRank]:
    count = shape.kv_heads // tp
    slot_bytes = count * shape.head_dim * 4
    ranks = []
    for r in range(tp):
        buffer = torch.randn(shape.layers, 2, SOURCE_SLOTS, count, shape.head_dim)
        staging = StagingArena(STAGING_BYTES)
        peers = PeerEngines("127.0.0.1", TransferProtocol.TCP, "", [buffer, staging.buffer])
        arena = KVArena(buffer.data_ptr(), shape.layers, SOURCE_SLOTS, slot_bytes, PAGE)
        ranks.append(SourceRank(buffer, peers, arena, HeadRange(r * count, count), Gatherer(staging, buffer, arena)))
    return ranks


def reserve(address: str, rid: str, tokens: list[int], source_tp: int) -> pb.KVDestination:
    """A reservation for a prefill node of ``source_tp`` ranks (the decode node stages their writes
    where they hold fewer heads than its ranks, as for the router's Reserve)."""
    with grpc.insecure_channel(address) as channel:
        request = pb.ReserveRequest(request_id=rid, prompt_ids=tokens, max_new_tokens=1, lease_seconds=LEASE_S,
                                    source_tp_size=source_tp)
        return pb_grpc.DecodeServiceStub(channel).Reserve(request).destination


def release(address: str, rid: str) -> None:
    with grpc.insecure_channel(address) as channel:
        pb_grpc.DecodeServiceStub(channel).Release(pb.ReleaseRequest(reservation_id=rid, writer_stopped=True))


def handoff_once(ranks: list[SourceRank], dest: pb.KVDestination, shape: ModelShape, tokens: int) -> tuple[float, int]:
    """Every prefill rank's ``KVHandoff`` into ``dest``: (construction to the last result() s, bytes)."""
    head_bytes = shape.head_dim * 4
    dests = destination_ranks(dest, head_bytes)
    pages = list(range(-(-tokens // PAGE)))
    start = time.perf_counter()
    handoffs = [KVHandoff(r.peers, plan_routes(r.held, head_bytes, dests), r.arena, list(dest.pages), 0, tokens,
                          gatherer=r.gatherer) for r in ranks]
    for layer in range(shape.layers):
        for h in handoffs:
            h.on_layer(layer, pages, tokens)
    results = [h.result(120) for h in handoffs]
    elapsed = time.perf_counter() - start
    if errors := [r.error for r in results if r.error]:
        raise RuntimeError(f"handoff failed: {errors}")
    return elapsed, sum(r.bytes for r in results)


def raw_once(rank: SourceRank, dest: pb.KVDestination, nbytes: int) -> float:
    """``nbytes`` as one block, one synchronous write, into the decode node's rank 0 arena."""
    target = dest.transfer_endpoint
    with _engine(rank, target) as handle:
        start = time.perf_counter()
        ok = handle.write(target, [(rank.arena.base, dest.base_address, nbytes)])
        elapsed = time.perf_counter() - start
    if not ok:
        raise RuntimeError("raw write failed")
    return elapsed


@contextlib.contextmanager
def _engine(rank: SourceRank, target: str) -> Iterator[TransferEngineHandle]:
    """The rank's engine for ``target``, held (``PeerEngines``' reference count) while in use."""
    handle = rank.peers.acquire(target)
    try:
        yield handle
    finally:
        rank.peers.release(target)


def small_blocks(rank: SourceRank, dest: pb.KVDestination, nbytes: int, block_bytes: int) -> list[Block]:
    """``nbytes`` cut into ``block_bytes`` blocks, consecutive on both sides: the entry count and
    size of a handoff between TP sizes (one head sub-range of one token's K or V per block)."""
    return [(rank.arena.base + at, dest.base_address + at, block_bytes) for at in range(0, nbytes, block_bytes)]


def raw_blocks_once(rank: SourceRank, dest: pb.KVDestination, blocks: list[Block]) -> float:
    """``blocks`` on the raw engine handle, batches of ``MAX_BATCH_ENTRIES`` and at most
    ``MAX_INFLIGHT_ENTRIES`` in flight (the handoff's limits), without our sender thread."""
    target = dest.transfer_endpoint
    with _engine(rank, target) as handle:
        start = time.perf_counter()
        inflight: deque[tuple[int, int]] = deque()
        ok = True
        for at in range(0, len(blocks), MAX_BATCH_ENTRIES):
            part = blocks[at : at + MAX_BATCH_ENTRIES]
            while inflight and sum(n for _, n in inflight) + len(part) > MAX_INFLIGHT_ENTRIES:
                ok &= handle.wait(inflight.popleft()[0])
            inflight.append((handle.submit(target, part), len(part)))
        while inflight:
            ok &= handle.wait(inflight.popleft()[0])
        elapsed = time.perf_counter() - start
    if not ok:
        raise RuntimeError("raw block writes failed")
    return elapsed


def blocks_submitted(ranks: list[SourceRank], dest: pb.KVDestination, shape: ModelShape, tokens: int) -> int:
    """Blocks the handoff submits over all ranks and layers: one per run of consecutive slots, K/V,
    layer and route; per token only where a route neither gathers nor is staged (no staging room)."""
    head_bytes = shape.head_dim * 4
    dests = destination_ranks(dest, head_bytes)
    pages = list(range(-(-tokens // PAGE)))
    total = 0
    for r in ranks:
        for route in plan_routes(r.held, head_bytes, dests):
            runs = token_runs(pages, pages if route.by_token else list(dest.pages), 0, tokens, PAGE)
            per_layer = 2 * len(runs) if gathers(r.arena, route) else len(route_blocks(r.arena, route, runs, 0))
            total += per_layer * shape.layers
    return total


def measure(model: Path, shape: ModelShape, logs: Path, tokens: int, repeats: int, rpc_repeats: int
            ) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    decode = {d: NodeProcess("decode", node_args(model, d), logs / f"decode-tp{d}.log") for d in (1, 2)}
    prefill = ({p: NodeProcess("prefill", node_args(model, p), logs / f"prefill-tp{p}.log") for p in (1, 2)}
               if rpc_repeats else {})
    try:
        for node in [*decode.values(), *prefill.values()]:
            node.wait_ready(180)
        nbytes = tokens * shape.token_bytes
        sources = {p: source_ranks(shape, p) for p in (1, 2)}
        dests = {(p, d): reserve(decode[d].address, f"wire-{p}{d}", prompt(tokens, 700 + 10 * p + d), p)
                 for p, d in PAIRINGS}
        try:
            wire = wire_rounds(sources, dests, shape, tokens, nbytes, repeats)
            wire[0] |= {f"blocks P{p}->D{d}": float(blocks_submitted(sources[p], dests[(p, d)], shape, tokens))
                        for p, d in PAIRINGS}
        finally:
            for (p, d) in PAIRINGS:
                release(decode[d].address, f"wire-{p}{d}")
        rpc = asyncio.run(rpc_rounds(prefill, decode, tokens, rpc_repeats)) if rpc_repeats else []
        return wire, rpc
    finally:
        for node in [*decode.values(), *prefill.values()]:
            node.stop()


def wire_rounds(sources: dict[int, list[SourceRank]], dests: dict[tuple[int, int], pb.KVDestination],
                shape: ModelShape, tokens: int, nbytes: int, repeats: int) -> list[dict[str, float]]:
    names = [f"P{p}->D{d}" for p, d in PAIRINGS] + ["raw->D1", "raw->D2", "raw blocks->D1"]
    small = small_blocks(sources[1][0], dests[(1, 1)], nbytes, shape.kv_heads // 2 * shape.head_dim * 4)
    rounds = []
    for turn in range(repeats + 1):
        sample: dict[str, float] = {}
        for name in rotated(names, turn):
            if name == "raw blocks->D1":
                sample[name] = raw_blocks_once(sources[1][0], dests[(1, 1)], small)
            elif name.startswith("raw"):
                d = int(name[-1])
                sample[name] = raw_once(sources[1][0], dests[(1, d)], nbytes)
            else:
                p, d = int(name[1]), int(name[-1])
                sample[name], sent = handoff_once(sources[p], dests[(p, d)], shape, tokens)
                if sent != nbytes:
                    raise RuntimeError(f"{name} moved {sent} bytes, the prompt's KV is {nbytes}")
        print(f"  handoff {'warm-up' if not turn else f'round {turn}'} (ms): "
              + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sample.items()), flush=True)
        if turn:
            rounds.append(sample)
    return rounds


async def rpc_rounds(prefill: dict[int, NodeProcess], decode: dict[int, NodeProcess], tokens: int,
                     repeats: int) -> list[dict[str, float]]:
    """Reserve + Prefill through the real nodes (compute and handoff overlapped), pairings rotating."""
    names = [f"P{p}->D{d}" for p, d in PAIRINGS]
    sampling = pb.SamplingOptions(max_tokens=1, temperature=0, ignore_eos=True)
    rounds = []
    for turn in range(repeats + 1):
        sample: dict[str, float] = {}
        for name in rotated(names, turn):
            p, d = int(name[1]), int(name[-1])
            async with grpc.aio.insecure_channel(prefill[p].address) as pc, \
                    grpc.aio.insecure_channel(decode[d].address) as dc:
                pair = pd_flow.Pair.connect(pc, dc)
                start = time.perf_counter()
                done = await pd_flow.prefill(pair, f"rpc-{turn}-{p}{d}", prompt(tokens, 5000 + turn * 10 + p * 3 + d),
                                             sampling, timeout_s=120, source_tp=p)
                sample[f"{name} wall"] = time.perf_counter() - start
                await pd_flow.release(pair, done.reservation_id, writer_stopped=True)
            r = done.response
            sample[f"{name} transfer"], sample[f"{name} exposed"] = r.transfer_seconds, r.exposed_transfer_seconds
        print(f"  Prefill RPC {'warm-up' if not turn else f'round {turn}'} (s): "
              + ", ".join(f"{k} {v:.3f}" for k, v in sample.items()), flush=True)
        if turn:
            rounds.append(sample)
    return rounds


def report(wire: list[dict[str, float]], rpc: list[dict[str, float]], shape: ModelShape, tokens: int) -> list[str]:
    nbytes = tokens * shape.token_bytes
    gb = nbytes / 1e9
    lines = [f"{tokens}-token prompt, {nbytes / 2**20:.1f} MiB of KV; medians of {len(wire)} rounds; ratios: "
             "medians of the per-round ratios of times; raw: one block; raw, mixed entries: the same bytes in "
             "blocks of a mixed handoff's size and count, into D1", "",
             "| pairing | blocks submitted | handoff (ms) | GB/s | raw into the same decode node (ms) "
             "| **raw / handoff time** | raw, mixed entries / handoff time |", "|---|---:|---:|---:|---:|---:|---:|"]
    for p, d in PAIRINGS:
        name, raw = f"P{p}->D{d}", f"raw->D{d}"
        mixed = f"{median_ratio(wire, 'raw blocks->D1', name):.2f}" if p != d else "-"
        lines.append(f"| P{p} -> D{d} | {wire[0]['blocks ' + name]:.0f} | {median(wire, name) * 1e3:.1f} "
                     f"| {gb / median(wire, name):.2f} | {median(wire, raw) * 1e3:.1f} "
                     f"| **{median_ratio(wire, raw, name):.3f}** | {mixed} |")
    block = shape.kv_heads // 2 * shape.head_dim * 4
    count = len(range(0, nbytes, block))
    lines += ["", f"The raw engine with a mixed handoff's entries ({count} blocks of {block} B into D1, the "
              f"handoff's batch and in-flight limits): {median(wire, 'raw blocks->D1') * 1e3:.1f} ms, "
              f"{median(wire, 'raw blocks->D1') / count * 1e6:.1f} us per entry; one block / those blocks, time: "
              f"{median_ratio(wire, 'raw->D1', 'raw blocks->D1'):.3f}"]
    if rpc:
        lines += ["", f"The real path, Reserve + Prefill RPC (compute and handoff overlapped), medians of {len(rpc)}:",
                  "", "| pairing | RPC wall (s) | transfer_seconds | exposed_transfer_seconds |",
                  "|---|---:|---:|---:|"]
        for p, d in PAIRINGS:
            name = f"P{p}->D{d}"
            lines.append(f"| P{p} -> D{d} | {median(rpc, name + ' wall'):.3f} | {median(rpc, name + ' transfer'):.3f} "
                         f"| {median(rpc, name + ' exposed'):.3f} |")
    return lines
