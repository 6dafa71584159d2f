"""KV handoff prefill -> decode: our ``KVHandoff`` vs the raw transfer engine, same run.

A real decode node (its own process, the built-in model, float32) reserves pages for a
``--tokens``-token prompt; this process runs the prefill engine with a ``KVHandoff`` into them,
exactly as a prefill node does. Measured on the same pair of transfer engines:

- **overlap** (``--repeats`` prefills): the prompt's prefill on the engine, which calls the
  handoff's ``on_layer`` after each layer's KV is written, so a layer's transfer runs while later
  layers compute; reported: compute time, the handoff's first submission to last completion, and
  what is left after the compute ended (exposed);
- **wire** (``--wire-repeats`` rounds after each prefill, the three in rotating order):
  - ``handoff``: a new ``KVHandoff`` driven as the engine drives it, with the KV already in place:
    ``on_layer`` for every layer (blocks computed on this thread, queued to the handoff's sender
    thread, which submits and waits), then ``result()``; timed from construction to ``result()``;
  - ``blocks``: the same per-layer block lists (precomputed) submitted back to back on the raw
    engine handle, then waited for: the engine's cost for our coalescing, without our thread/queue;
  - ``raw``: the same number of bytes as one block in one synchronous call (the engine's best case);
  - with ``--layer-ms MS``, also ``paced``: a handoff whose ``on_layer`` calls are ``MS`` apart, as
    a prefill ~``MS`` ms per layer (e.g. a GPU's) would issue them; its exposed part is reported.

Reported: medians; handoff / raw and handoff / blocks as medians of the per-round ratios of
times (raw / handoff as bandwidth, target >= 0.8); the share of the transfer hidden behind
compute, 1 - exposed / (the handoff's time with no compute).

    .venv/bin/python benchmarks/transfer.py [--tokens 4096] [--repeats 3] [--wire-repeats 5] [--layer-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from tierserve.core.sampling import SamplingParams
from tierserve.core.transfer import TransferProtocol
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.launch import free_port, grpc_serving
from tierserve.model.fetch import fetch_builtin_model
from tierserve.node.convert import arena, destination_arena
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.transfer.engine import PeerEngines
from tierserve.transfer.handoff import KVHandoff
from tierserve.transfer.layout import KVArena, Route, layer_blocks, token_runs

LEASE_S = 600.0  # a reservation outlives its prefill and all of its wire rounds


def start_decode(model: Path, port: int, tokens: int, log: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "tierserve.cli", "decode", "--model", str(model), "--port", str(port),
            "--device", "cpu", "--dtype", "float32", "--max-total-tokens", str(tokens), "--disable-radix-cache",
            "--log-level", "warning"]
    proc = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not grpc_serving(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"decode node did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)  # poll interval
    return proc


def reserve(port: int, rid: str, prompt: list[int]) -> pb.KVDestination:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        request = pb.ReserveRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=1, lease_seconds=LEASE_S)
        return stub.Reserve(request).destination


def release(port: int, rid: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        pb_grpc.DecodeServiceStub(channel).Release(pb.ReleaseRequest(reservation_id=rid, writer_stopped=True))


class RecordingHandoff(KVHandoff):
    """A ``KVHandoff`` that remembers the page table the engine passed (for the wire rounds)."""

    pages: list[int] | None = None

    def on_layer(self, layer: int, pages: list[int], end: int) -> None:
        if layer == 0:
            self.pages = list(pages)
        super().on_layer(layer, pages, end)


class Pair:
    """One reservation: the source arena and page table, the destination, and the prompt length."""

    def __init__(self, engine: Engine, peers: PeerEngines, dest: pb.KVDestination, num_tokens: int) -> None:
        self.engine, self.peers, self.dest, self.num_tokens = engine, peers, dest, num_tokens
        self.target = dest.transfer_endpoint
        self.src: KVArena = arena(engine)
        self.dst: KVArena = destination_arena(dest, self.src.slot_bytes)
        self.src_pages: list[int] = []  # set by the prefill

    def handoff(self, cls: type[KVHandoff] = KVHandoff) -> KVHandoff:
        whole = Route(self.target, self.dst, 0, 0, self.src.slot_bytes)  # TP 1 -> TP 1: every head of every slot
        return cls(self.peers, [whole], self.src, list(self.dest.pages), 0, self.num_tokens)


def prefill_once(pair: Pair, prompt: list[int], rid: str) -> dict[str, float]:
    """The engine's prefill with the handoff: compute s, transfer s, exposed s."""
    handoff = pair.handoff(RecordingHandoff)
    engine = pair.engine
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), handoff=handoff)
    while engine.scheduler.running or engine.scheduler.waiting:
        engine.step()
    compute = time.perf_counter() - start
    result = handoff.result(120)
    if result.error:
        raise RuntimeError(result.error)
    while engine.has_work():  # hands the parked pages back
        engine.step()
    pair.src_pages = handoff.pages
    return {"compute": compute, "transfer": result.transfer_seconds, "exposed": result.exposed_seconds,
            "bytes": result.bytes}


def handoff_once(pair: Pair, layer_s: float = 0.0) -> tuple[float, float]:
    """A handoff driven as the engine drives it, every layer's KV ready (after ``layer_s`` of
    'compute' each when pacing); returns (construction to result() s, exposed s)."""
    start = time.perf_counter()
    handoff = pair.handoff()
    for layer in range(pair.src.num_layers):
        if layer_s:
            time.sleep(layer_s)
        handoff.on_layer(layer, pair.src_pages, pair.num_tokens)
    result = handoff.result(120)
    elapsed = time.perf_counter() - start
    if result.error:
        raise RuntimeError(result.error)
    return elapsed, result.exposed_seconds


def blocks_once(pair: Pair, per_layer: list) -> float:
    """The handoff's block lists submitted back to back on the raw engine, then waited for."""
    handle = pair.peers.acquire(pair.target)
    try:
        start = time.perf_counter()
        batches = [handle.submit(pair.target, blocks) for blocks in per_layer]
        failed = [layer for layer, b in enumerate(batches) if not handle.wait(b)]
        elapsed = time.perf_counter() - start
    finally:
        pair.peers.release(pair.target)
    if failed:
        raise RuntimeError(f"block replay failed for layers {failed}")
    return elapsed


def raw_once(pair: Pair, nbytes: int) -> float:
    handle = pair.peers.acquire(pair.target)
    try:
        start = time.perf_counter()
        ok = handle.write(pair.target, [(pair.src.base, pair.dest.base_address, nbytes)])
        elapsed = time.perf_counter() - start
    finally:
        pair.peers.release(pair.target)
    if not ok:
        raise RuntimeError("raw write failed")
    return elapsed


def wire_round(pair: Pair, per_layer: list, nbytes: int, layer_s: float, turn: int) -> dict[str, float]:
    """One of each, the order rotating with ``turn`` so none always runs first or after another."""
    ops = {"handoff": lambda: handoff_once(pair)[0], "blocks": lambda: blocks_once(pair, per_layer),
           "raw": lambda: raw_once(pair, nbytes)}
    out: dict[str, float] = {}
    if layer_s:
        def paced() -> None:
            out["paced"], out["paced_exposed"] = handoff_once(pair, layer_s)
        ops["paced"] = paced
    names = list(ops)
    names = names[turn % len(names):] + names[: turn % len(names)]
    if (turn // len(names)) % 2:
        names.reverse()
    for name in names:
        value = ops[name]()
        if value is not None:
            out[name] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3, help="prefills with the handoff (after one warm-up)")
    parser.add_argument("--wire-repeats", type=int, default=5, help="wire rounds after each prefill")
    parser.add_argument("--layer-ms", type=float, default=0.0,
                        help="also a handoff paced at one layer per MS ms (0: off)")
    parser.add_argument("--port", type=int, default=0, help="decode node gRPC port (0: pick one)")
    args = parser.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    model = fetch_builtin_model(progress=True)
    pool_tokens = args.tokens + 512
    port = args.port or free_port()
    decode = start_decode(model, port, pool_tokens, Path(tempfile.mkdtemp()) / "decode.log")
    try:
        engine = Engine(EngineConfig(model, device="cpu", dtype="float32", max_total_tokens=pool_tokens,
                                     chunked_prefill_size=args.tokens, disable_radix_cache=True))
        peers = PeerEngines("127.0.0.1", TransferProtocol.TCP, "", [engine.pool.buffer])
        prefills, wires = [], []
        for i in range(args.repeats + 1):  # repetition 0 warms up the engines and the handshake
            p, w = measure(engine, peers, port, args, i)
            if i:
                prefills.append(p)
                wires += w
    finally:
        decode.terminate()
        decode.wait(30)
    report(prefills, wires, args)


def measure(engine: Engine, peers: PeerEngines, port: int, args: argparse.Namespace, i: int
            ) -> tuple[dict[str, float], list[dict[str, float]]]:
    prompt = [random.Random(i).randrange(2, 49000) for _ in range(args.tokens)]
    rid = f"bench-{i}"
    dest = reserve(port, rid, prompt)
    try:
        pair = Pair(engine, peers, dest, args.tokens)
        pre = prefill_once(pair, prompt, rid)
        runs = token_runs(pair.src_pages, list(dest.pages), 0, args.tokens, pair.src.page_size)
        per_layer = [layer_blocks(pair.src, pair.dst, runs, layer) for layer in range(pair.src.num_layers)]
        nbytes = sum(b[2] for blocks in per_layer for b in blocks)
        if nbytes != pre["bytes"]:
            raise RuntimeError(f"block lists move {nbytes} bytes, the handoff moved {pre['bytes']}")
        rounds = [wire_round(pair, per_layer, nbytes, args.layer_ms / 1e3, i * args.wire_repeats + k)
                  for k in range(args.wire_repeats)]
    finally:
        release(port, rid)
    tag = "warm-up" if not i else f"repeat {i}"
    print(f"{tag}: prefill compute {pre['compute']:.2f}s, transfer {pre['transfer']:.3f}s, "
          f"exposed {pre['exposed']:.3f}s; {len(runs)} runs/layer; wire (ms) "
          + "; ".join(", ".join(f"{k} {v * 1e3:.0f}" for k, v in r.items()) for r in rounds), flush=True)
    return pre, rounds


def report(prefills: list[dict[str, float]], wires: list[dict[str, float]], args: argparse.Namespace) -> None:
    pre = {k: statistics.median(r[k] for r in prefills) for k in prefills[0]}
    wire = {k: statistics.median(r[k] for r in wires) for k in wires[0]}
    ratio = {name: statistics.median(r[a] / r[b] for r in wires)
             for name, a, b in (("handoff", "handoff", "raw"), ("blocks", "blocks", "raw"),
                                ("handoff/blocks", "handoff", "blocks"))}
    gb = pre["bytes"] / 1e9
    print(f"\n{args.tokens}-token prompt, {pre['bytes'] / 2**20:.0f} MiB of KV; prefill: medians of {len(prefills)}; "
          f"wire: medians of {len(wires)} rounds (ratios: median of the per-round ratios)\n")
    print("| measure | value |\n|---|---:|")
    print(f"| prefill compute (s) | {pre['compute']:.2f} |")
    print(f"| handoff during prefill: first submission to last completion (s) | {pre['transfer']:.2f} |")
    print(f"| handoff during prefill: exposed after compute (s) | {pre['exposed']:.3f} |")
    print(f"| handoff, no compute: construction to result() (s) | {wire['handoff']:.3f} |")
    print(f"| raw engine, same blocks back to back (s) | {wire['blocks']:.3f} |")
    print(f"| raw engine, one block (s) | {wire['raw']:.3f} |")
    print(f"| handoff / blocks / raw (GB/s) | {gb / wire['handoff']:.2f} / {gb / wire['blocks']:.2f} / "
          f"{gb / wire['raw']:.2f} |")
    print(f"| **raw / handoff time (handoff's share of raw bandwidth)** | **{1 / ratio['handoff']:.2f}** |")
    print(f"| blocks / handoff time (what our thread and queue leave of the engine's) | "
          f"{1 / ratio['handoff/blocks']:.2f} |")
    print(f"| raw / blocks time | {1 / ratio['blocks']:.2f} |")
    hidden = 1 - min(pre["exposed"], wire["handoff"]) / wire["handoff"]
    print(f"| **share of transfer hidden behind compute** (1 - exposed / handoff alone) | **{hidden:.2f}** |")
    if "paced" in wire:
        paced_hidden = 1 - min(wire["paced_exposed"], wire["handoff"]) / wire["handoff"]
        print(f"| paced at {args.layer_ms:g} ms/layer: construction to result() (s) | {wire['paced']:.3f} |")
        print(f"| paced: exposed after the last layer (s) | {wire['paced_exposed']:.3f} |")
        print(f"| paced: share hidden | {paced_hidden:.2f} |")


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
