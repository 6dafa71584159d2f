"""KV handoff bandwidth: our prefill -> decode handoff vs the raw transfer engine, same run.

A real decode node (its own process, the built-in model, float32) reserves pages for a
``--tokens``-token prompt; this process runs the prefill engine with a ``KVHandoff`` into them,
exactly as a prefill node does, then measures on the same pair of transfer engines:

- **handoff**: the prompt's prefill with the KV sent layer by layer while later layers compute:
  total transfer time, and the part left after the last layer's compute (exposed);
- **replay**: the same per-layer block lists submitted back to back with no compute, i.e. what
  our coalescing and batching cost on the wire;
- **raw**: the same number of bytes as one block in one call (the engine's best case).

Reported: replay / raw bandwidth (target >= 0.8) and the share of the transfer hidden behind
compute, 1 - exposed / replay time. Medians of ``--repeats``.

    .venv/bin/python benchmarks/transfer.py [--tokens 4096] [--repeats 3]
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
from tierserve.transfer.layout import layer_blocks, token_runs


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
        return stub.Reserve(pb.ReserveRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=1)).destination


def release(port: int, rid: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        pb_grpc.DecodeServiceStub(channel).Release(pb.ReleaseRequest(reservation_id=rid, writer_stopped=True))


def handoff_once(engine: Engine, peers: PeerEngines, dest: pb.KVDestination, prompt: list[int], rid: str
                 ) -> tuple[float, float, float, int]:
    """Prefill with the handoff; returns (compute s, transfer s, exposed s, bytes)."""
    src = arena(engine)
    handoff = KVHandoff(peers, dest.transfer_endpoint, src, destination_arena(dest, src.slot_bytes),
                        list(dest.pages), 0, len(prompt))
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
    return compute, result.transfer_seconds, result.exposed_seconds, result.bytes


def replay_once(engine: Engine, peers: PeerEngines, dest: pb.KVDestination, num_tokens: int) -> float:
    """The handoff's per-layer block lists, submitted back to back; returns seconds."""
    src = arena(engine)
    dst = destination_arena(dest, src.slot_bytes)
    runs = token_runs(list(range(len(dest.pages))), list(dest.pages), 0, num_tokens, src.page_size)
    handle = peers.acquire(dest.transfer_endpoint)
    start = time.perf_counter()
    batches = [handle.submit(dest.transfer_endpoint, layer_blocks(src, dst, runs, layer))
               for layer in range(src.num_layers)]
    failed = [layer for layer, b in enumerate(batches) if not handle.wait(b)]
    peers.release(dest.transfer_endpoint)
    if failed:
        raise RuntimeError(f"replay failed for layers {failed} ({len(runs)} runs per layer)")
    return time.perf_counter() - start


def raw_once(engine: Engine, peers: PeerEngines, dest: pb.KVDestination, nbytes: int) -> float:
    handle = peers.acquire(dest.transfer_endpoint)
    start = time.perf_counter()
    ok = handle.write(dest.transfer_endpoint, [(engine.pool.buffer.data_ptr(), dest.base_address, nbytes)])
    elapsed = time.perf_counter() - start
    peers.release(dest.transfer_endpoint)
    if not ok:
        raise RuntimeError("raw write failed")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
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
        rows = [measure(engine, peers, port, args.tokens, i) for i in range(args.repeats)]
    finally:
        decode.terminate()
        decode.wait(30)
    report(rows, args)


def measure(engine: Engine, peers: PeerEngines, port: int, tokens: int, i: int) -> dict[str, float]:
    prompt = [random.Random(i).randrange(2, 49000) for _ in range(tokens)]
    dest = reserve(port, f"bench-{i}", prompt)
    try:
        compute, transfer, exposed, nbytes = handoff_once(engine, peers, dest, prompt, f"bench-{i}")
        replay = replay_once(engine, peers, dest, tokens)
        raw = raw_once(engine, peers, dest, nbytes)
    finally:
        release(port, f"bench-{i}")
    row = {"compute": compute, "transfer": transfer, "exposed": exposed, "bytes": nbytes, "replay": replay, "raw": raw}
    print(f"repeat {i}: " + ", ".join(f"{k}={v:.3f}" if k != "bytes" else f"{k}={v}" for k, v in row.items()),
          flush=True)
    return row


def report(rows: list[dict[str, float]], args: argparse.Namespace) -> None:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    gb = med["bytes"] / 1e9
    replay_bw, raw_bw = gb / med["replay"], gb / med["raw"]
    hidden = 1 - min(med["exposed"], med["replay"]) / med["replay"]
    print(f"\n{args.tokens}-token prompt, {med['bytes'] / 2**20:.0f} MiB of KV, medians of {args.repeats}\n")
    print("| measure | value |\n|---|---:|")
    print(f"| prefill compute (s) | {med['compute']:.2f} |")
    print(f"| handoff: first submission to last completion (s) | {med['transfer']:.2f} |")
    print(f"| handoff: exposed after compute (s) | {med['exposed']:.3f} |")
    print(f"| replay of the handoff's blocks (GB/s) | {replay_bw:.2f} |")
    print(f"| raw, one block (GB/s) | {raw_bw:.2f} |")
    print(f"| **replay / raw** | **{replay_bw / raw_bw:.2f}** |")
    print(f"| **share of transfer hidden behind compute** | **{hidden:.2f}** |")


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
