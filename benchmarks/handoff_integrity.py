"""The cost of ``--handoff-integrity`` (``transfer/digest.py``) next to the handoff's bandwidth, in
one run: a real decode node (its own process, the built-in model, float32) reserves pages for a
``--tokens``-token prompt, this process prefills it once with a ``KVHandoff`` (as
``benchmarks/transfer.py`` does), then alternates wire rounds of the same handoff with and without
the sender's digests (each layer digested on the calling thread, as the engine thread does, while
the sender thread transfers the layer before). Also timed alone: the sender's digests of the whole
prompt, and the decode side's check (every layer's digest of the reserved pages, done once the KV
arrived, before the first decode step: on the request's critical path).

Run through ``benchmarks/integrity.py --handoff [--tokens 2048] [--repeats 15]``.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transfer import Pair, prefill_once, release, reserve, start_decode

from tierserve.core.transfer import TransferProtocol
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.launch import free_port
from tierserve.model.fetch import fetch_builtin_model
from tierserve.transfer.digest import SendDigests, layer_digest, slots_of
from tierserve.transfer.engine import PeerEngines
from tierserve.transfer.handoff import KVHandoff
from tierserve.transfer.layout import Route
from tierserve.transfer.receive_check import engine_weights


def digests(engine: Engine) -> SendDigests:
    g = engine.geometry
    return SendDigests(engine.pool.buffer, engine_weights(engine), (0, g.head_dim * g.dtype.itemsize), 0,
                       engine.model_config.num_layers)


def handoff_s(pair: Pair, checked: bool) -> float:
    """Construction to ``result()`` of a handoff of the whole prompt, every layer's KV in place."""
    start = time.perf_counter()
    whole = Route(pair.target, pair.dst, 0, 0, pair.src.slot_bytes)
    handoff = KVHandoff(pair.peers, [whole], pair.src, list(pair.dest.pages), 0, pair.num_tokens,
                        digests=digests(pair.engine) if checked else None)
    for layer in range(pair.src.num_layers):
        handoff.on_layer(layer, pair.src_pages, pair.num_tokens)
    result = handoff.result(120)
    if result.error:
        raise RuntimeError(result.error)
    return time.perf_counter() - start


def send_digests_s(pair: Pair) -> float:
    sums = digests(pair.engine)
    start = time.perf_counter()
    for layer in range(pair.src.num_layers):
        sums.add(layer, [(0, pair.src.slot_bytes)], pair.src_pages, 0, pair.num_tokens, pair.src.page_size)
    sums.values()
    return time.perf_counter() - start


def check_s(pair: Pair) -> float:
    """What a decode node computes before decoding: every layer, every head, the sent tokens."""
    engine, start = pair.engine, time.perf_counter()
    slots, positions = slots_of(pair.src_pages, 0, pair.num_tokens, pair.src.page_size)
    heads = (0, engine.geometry.num_kv_heads, 0)
    own = [layer_digest(engine.pool.buffer[layer], engine_weights(engine), layer, slots, positions, heads)
           for layer in range(engine.geometry.num_layers)]
    torch.stack(own).tolist()
    return time.perf_counter() - start


def measure_handoff(tokens: int, repeats: int) -> None:
    """Prints the table (``benchmarks/RESULTS.md``, handoff integrity)."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    model, port = fetch_builtin_model(progress=True), free_port()
    decode = start_decode(model, port, tokens + 512, Path(tempfile.mkdtemp()) / "decode.log")
    try:
        engine = Engine(EngineConfig(model, device="cpu", dtype="float32", max_total_tokens=tokens + 512,
                                     chunked_prefill_size=tokens, disable_radix_cache=True))
        peers = PeerEngines("127.0.0.1", TransferProtocol.TCP, "", [engine.pool.buffer])
        prompt = [random.Random(0).randrange(2, 49000) for _ in range(tokens)]
        dest = reserve(port, "bench", prompt)
        try:
            pair = Pair(engine, peers, dest, tokens)
            nbytes = prefill_once(pair, prompt, "bench")["bytes"]
            times = rounds(pair, repeats)
        finally:
            release(port, "bench")
    finally:
        decode.terminate()
        decode.wait(30)
    report(times, nbytes, tokens)


def rounds(pair: Pair, n: int) -> dict[str, list[float]]:
    """One warm-up, then ``n`` rounds of each, alternating which handoff goes first."""
    times: dict[str, list[float]] = {"off": [], "on": [], "digests": [], "check": []}
    for r in range(n + 1):
        order = ["off", "on"] if r % 2 else ["on", "off"]
        measured = {name: handoff_s(pair, name == "on") for name in order}
        measured |= {"digests": send_digests_s(pair), "check": check_s(pair)}
        for name, value in measured.items():
            if r:
                times[name].append(value)
    return times


def report(times: dict[str, list[float]], nbytes: int, tokens: int) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = statistics.median(on / off for on, off in zip(times["on"], times["off"], strict=True))
    print(f"\n{tokens}-token prompt, {nbytes / 2**20:.0f} MiB of KV; medians of {len(times['on'])} rounds\n")
    print("| measure | ms | GB/s |\n|---|---:|---:|")
    for name, label in (("off", "handoff, integrity off"), ("on", "handoff, sender digests on"),
                        ("digests", "sender digests alone"), ("check", "decode check alone")):
        print(f"| {label} | {med[name] * 1e3:.1f} | {nbytes / med[name] / 1e9:.2f} |")
    print(f"\nhandoff on/off: {ratio:.3f} (median of per-round ratios); with the decode check: "
          f"{(med['on'] + med['check']) / med['off']:.3f} of the handoff's time")

