"""Shared pieces of the prefill-decode integration tests: node flags, prompts, the reference
engine, the gRPC calls the router makes and a reader of the router's metrics."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import httpx

from helpers import metrics
from tierserve.core.sampling import SamplingParams
from tierserve.core.scope import CacheScope
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.router import pd_flow

PAGE, CHUNK, MAX_NEW = 16, 64, 12
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # tiny llama: layers x (K, V) x kv heads x head dim x float32
NODE_ARGS = ["--device", "cpu", "--dtype", "float32", "--page-size", str(PAGE), "--chunked-prefill-size", str(CHUNK),
             "--max-total-tokens", "4096"]
GRACE_S = 6.0  # decode nodes here: pages of an abandoned reservation come back after this (> the 5 s transfer timeout)
DECODE_ARGS = [*NODE_ARGS, "--reservation-grace", str(GRACE_S)]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.choice([5, 17, 40, 3 * CHUNK + 7, 5 * CHUNK]) for _ in range(n)]
    return [[rng.randrange(2, 384) for _ in range(length)] for length in lengths]


def reference(model: Path, batch: list[list[int]]) -> list[list[int]]:
    engine = Engine(EngineConfig(model, device="cpu", dtype="float32", page_size=PAGE, chunked_prefill_size=CHUNK,
                                 max_total_tokens=4096))
    return engine.generate(batch, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))


def greedy(max_tokens: int = MAX_NEW) -> pb.SamplingOptions:
    return pb.SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def run_pd(prefill: str, decode: str, rid: str, prompt: list[int], salt: str = "", source_tp: int | None = None
                 ) -> tuple[list[int], pb.PrefillResponse]:
    """Reserve, Prefill and Generate as the router does (``source_tp``: what the Reserve names as
    the prefill node's TP size; None: its real one, from Info, as the router sends it)."""
    async with grpc.aio.insecure_channel(prefill) as p, grpc.aio.insecure_channel(decode) as d:
        pair = pd_flow.Pair.connect(p, d)
        if source_tp is None:
            source_tp = (await pb_grpc.NodeServiceStub(p).Info(pb.InfoRequest())).tp_size
        done = await pd_flow.prefill(pair, rid, prompt, greedy(), CacheScope(cache_salt=salt), timeout_s=60,
                                     source_tp=source_tp)
        tokens = [t async for chunk in pd_flow.generate(pair, done, greedy()) for t in chunk.token_ids]
        return tokens, done.response


async def load(address: str) -> pb.LoadReport:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.NodeServiceStub(channel).Load(pb.LoadRequest())


async def reserve(decode: str, rid: str, prompt: list[int], lease: float = 0.0) -> pb.ReserveResponse:
    async with grpc.aio.insecure_channel(decode) as channel:
        return await pb_grpc.DecodeServiceStub(channel).Reserve(
            pb.ReserveRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=MAX_NEW, lease_seconds=lease))


async def reserve_for(decode: str, rid: str, prompt: list[int], source_tp: int) -> pb.ReserveResponse:
    """A Reserve that names the prefill node's TP size (its writers), for 4 new tokens."""
    async with grpc.aio.insecure_channel(decode) as channel:
        return await pb_grpc.DecodeServiceStub(channel).Reserve(
            pb.ReserveRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=4, source_tp_size=source_tp))


async def prefill_into(prefill: str, rid: str, prompt: list[int], dest: pb.KVDestination) -> pb.PrefillResponse:
    """A Prefill whose KV goes to ``dest`` (a destination a test may have altered)."""
    async with grpc.aio.insecure_channel(prefill) as channel:
        return await pb_grpc.PrefillServiceStub(channel).Prefill(
            pb.PrefillRequest(request_id=rid, prompt_ids=prompt, sampling=greedy(), destination=dest))


async def info(address: str) -> pb.NodeInfo:
    """A node's Info (its role's sizes: TP, PP)."""
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.NodeServiceStub(channel).Info(pb.InfoRequest())


async def release(decode: str, rid: str, writer_stopped: bool) -> bool:
    async with grpc.aio.insecure_channel(decode) as channel:
        reply = await pb_grpc.DecodeServiceStub(channel).Release(
            pb.ReleaseRequest(reservation_id=rid, writer_stopped=writer_stopped))
        return reply.released


def metric(router, name: str, **labels: str) -> float:
    """One sample of a router's (``RouterProcess``) /metrics; 0 while it has not appeared."""
    return metrics.value(httpx.get(f"{router.url}/metrics").text, name, **labels)


def node_metric(node, name: str) -> float:
    """One sample of a node's (``NodeProcess``) /metrics, on the port its ``--metrics-port`` names."""
    port = node.proc.args[node.proc.args.index("--metrics-port") + 1]
    found = metrics.find(metrics.scrape(f"http://127.0.0.1:{port}"), name)
    assert found is not None, f"{name} not on the node's /metrics"
    return found


async def run_all(prefill: str, decode: str, batch: list[list[int]], tag: str, source_tp: int | None = None
                  ) -> list[tuple[list[int], pb.PrefillResponse]]:
    """``run_pd`` of every prompt of ``batch`` at once (ids ``tag`` + index)."""
    return await asyncio.gather(*(run_pd(prefill, decode, f"{tag}{i}", p, source_tp=source_tp)
                                  for i, p in enumerate(batch)))


async def idle(prefill: str, decode: str) -> bool:
    """Both nodes gave every page and staging byte back (nothing parked, used, reserved or staged)."""
    p, d = await load(prefill), await load(decode)
    return p.kv_pages_parked == 0 and d.kv_pages_used == 0 and d.reservations == 0 and d.staging_bytes_used == 0


def run_pair(prefill_args: list[str], decode_args: list[str], logs: tuple[Path, Path], seed: int, tag: str
             ) -> tuple[list[list[int]], list[tuple[list[int], pb.PrefillResponse]]]:
    """Starts a prefill and a decode node (``NodeProcess``) with these arguments, sends four fresh
    prompts of ``seed`` through them one at a time as the router does, and stops both: the prompts
    and each one's tokens and Prefill response."""
    from helpers.processes import NodeProcess

    nodes = [NodeProcess("prefill", prefill_args, logs[0]), NodeProcess("decode", decode_args, logs[1])]
    try:
        prefill, decode = (n.wait_ready() for n in nodes)
        batch = prompts(4, seed=seed)
        return batch, [asyncio.run(run_pd(prefill.address, decode.address, f"{tag}{i}", q))
                       for i, q in enumerate(batch)]
    finally:
        for node in nodes:
            node.stop()
