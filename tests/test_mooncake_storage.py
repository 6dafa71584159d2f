"""L3 on a real Mooncake Store: the backend against a real ``mooncake_master``, two engines sharing
pages through it, and a master that dies and comes back while requests run."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.engine_runs import run_one
from helpers.mooncake_engines import PAGE, PARAMS, SEGMENT, l3_engine, prompt_of, settle
from helpers.processes import MasterProcess, free_port

from tierserve.cache import storage_tier
from tierserve.cache.options import HostLayout
from tierserve.cache.storage import StorageError, create_backend
from tierserve.cache.storage.integrity import Trailers

# Through our module, which sets Mooncake's environment defaults before Mooncake loads. A plain
# import: `make test` installs Mooncake, so a failure here is a broken setup, not a reason to skip.
from tierserve.cache.storage.mooncake import MooncakeStorage
from tierserve.engine.engine import Engine

pytestmark = pytest.mark.integration


def _backend(master: MasterProcess, closing: Callable[[Any], Any]) -> MooncakeStorage:
    config = {"master_server_address": master.address, "global_segment_size": SEGMENT,
              "local_buffer_size": 16 << 20}
    return closing(create_backend("mooncake", config))


# -- the backend -----------------------------------------------------------------------------------


def test_round_trip_through_a_real_master(mooncake_master: MasterProcess, closing) -> None:
    store = _backend(mooncake_master, closing)
    pool = torch.randn(10, 1024)  # 10 pages of 4 KiB in one registered buffer
    store.register_buffer(pool)
    store.register_buffer(pool[3])  # already covered: a no-op (Mooncake itself would answer -600)
    keys = [bytes([i]) * 32 for i in range(5)]
    assert store.batch_set_from(keys[:4], list(pool[:4])) == [True] * 4
    assert store.batch_exists(keys) == 4
    assert store.batch_exists([keys[0], keys[4], keys[1]]) == 1  # leading keys only
    untouched = pool[8].clone()
    assert store.batch_get_into(keys, list(pool[4:9])) == [True] * 4 + [False]
    assert torch.equal(pool[4:8], pool[:4]) and torch.equal(pool[8], untouched)
    assert store.batch_set_from(keys[:1], [pool[9]]) == [True]  # stored already: keeps the old bytes
    assert store.batch_get_into(keys[:1], [pool[8]]) == [True] and torch.equal(pool[8], pool[0])
    assert store.set(b"x" * 32, b"abc") and store.get(b"x" * 32) == b"abc" and store.get(b"y" * 32) is None
    assert store.stats()["registered_buffers"] == 2 and store.stats()["hits"] == 5  # the pool, the trailers
    store.clear()
    assert store.batch_exists(keys) == 0 and store.get(b"x" * 32) is None
    store.close()
    with pytest.raises(StorageError, match="closed"):  # the store itself would crash the process
        store.batch_exists(keys)


def test_a_dead_master_fails_fast_and_recovery_is_seen(mooncake_master: MasterProcess, closing) -> None:
    store = _backend(mooncake_master, closing)
    pool = torch.randn(2, 1024)
    store.register_buffer(pool)
    mooncake_master.kill()
    with pytest.raises(StorageError):
        store.batch_exists([b"k" * 32])
    started = time.monotonic()
    with pytest.raises(StorageError, match="unreachable"):  # probed first, instead of ~4.3 s of RPC
        store.batch_get_into([b"k" * 32], [pool[0]])
    assert time.monotonic() - started < 1.0
    mooncake_master.start()  # an empty store; the client re-mounts its segment within ~1-2 s
    _wait_until_writable(store)
    assert store.batch_set_from([b"k" * 32], [pool[0]]) == [True]
    assert store.batch_get_into([b"k" * 32], [pool[1]]) == [True] and torch.equal(pool[0], pool[1])


PEER = """
import sys, time, torch
from tierserve.cache.storage.mooncake import MooncakeStorage
store = MooncakeStorage(sys.argv[1], global_segment_size=32 << 20, local_buffer_size=16 << 20)
pool = torch.ones(8, 1024)
store.register_buffer(pool)
print(sum(store.batch_set_from([bytes([i]) * 32 for i in range(8)], list(pool))), flush=True)
time.sleep(300)
"""


def test_a_dead_peers_objects_are_misses_not_an_outage(mooncake_master: MasterProcess, closing) -> None:
    """When a node dies the master still lists its segment for ~10 s: its objects fail with -800
    on every other node. Those are misses and dropped writes, never a store failure (which would
    switch L3 off on every node)."""
    peer = subprocess.Popen([sys.executable, "-c", PEER, mooncake_master.address], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "8"  # all 8 pages on the peer
        store = _backend(mooncake_master, closing)  # its own segment holds nothing yet
        pool = torch.zeros(16, 1024)
        store.register_buffer(pool)
        keys = [bytes([i]) * 32 for i in range(8)]
        assert store.batch_exists(keys) == 8
    finally:
        peer.kill()
        peer.wait()
    assert store.batch_get_into(keys, list(pool[:8])) == [False] * 8  # no StorageError
    fresh = [bytes([100 + i]) * 32 for i in range(8)]
    stored = store.batch_set_from(fresh, list(pool[8:]))  # some may be placed on the dead segment
    assert store.batch_get_into([k for k, ok in zip(fresh, stored, strict=True) if ok], list(pool[:sum(stored)])) \
        == [True] * sum(stored)
    stats = store.stats()
    assert stats["failures"] == 0 and not stats["master_suspect"] and stats["peer_failures"] >= 8


def test_setup_against_no_master_fails_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(StorageError, match="unreachable"):
        MooncakeStorage(f"127.0.0.1:{free_port()}")
    assert time.monotonic() - started < 1.0


def _wait_until_writable(store: MooncakeStorage, deadline_s: float = 15.0) -> None:
    """Until a write through ``store`` lands: after a master restart its client answers -900 until
    it reconnects, then -200 until a client re-mounts a segment (~1-5 s in all)."""
    deadline = time.monotonic() + deadline_s
    while not _try_set(store):
        assert time.monotonic() < deadline, "the restarted master never accepted a write"
        time.sleep(0.05)


def _try_set(store: MooncakeStorage) -> bool:
    try:
        return store.set(b"\xff" * 32, b"probe")
    except StorageError:
        return False


# -- engines ---------------------------------------------------------------------------------------


TRAILERS = Trailers().buffer.nbytes  # cache/storage/integrity.py


def _registered_once(engine: Engine) -> bool:
    """The host pool is registered with Mooncake as one buffer, never page by page (plus the
    integrity trailers' buffer)."""
    stats = engine.cache.storage.storage.stats()
    pool = engine.cache.host.buffer.untyped_storage().nbytes()  # with the pages' trailer room
    return stats["registered_buffers"] == 2 and stats["registered_bytes"] == pool + TRAILERS


def test_second_engine_reads_the_first_engines_pages_from_mooncake(long_llama: Path, plain, mooncake_master,
                                                                  closing, caplog) -> None:
    prompt = prompt_of(7, 800)
    first = l3_engine(long_llama, mooncake_master, closing)
    assert run_one(first, prompt, PARAMS)[0] == plain(prompt)
    settle(first)
    assert first.cache.storage.backed_up_pages == (800 + PARAMS.max_tokens - 1) // PAGE  # prompt + answer
    assert _registered_once(first)
    second = l3_engine(long_llama, mooncake_master, closing)  # empty L1 and L2, its own client, same store
    tokens, tiers = run_one(second, prompt, PARAMS)
    assert tokens == plain(prompt)
    assert tiers.get("storage", 0) >= 0.9 * 800, tiers
    assert second.cache.storage.storage.stats()["hits"] >= 45 and _registered_once(second)
    assert "on first use" not in caplog.text  # HiCache registered the pool through attach_host_buffer


def test_layer_first_pages_go_through_mooncake_via_the_registered_staging_buffer(long_llama: Path, plain,
                                                                                 mooncake_master, closing) -> None:
    prompt = prompt_of(8, 400)
    first = l3_engine(long_llama, mooncake_master, closing, HostLayout.LAYER_FIRST)
    assert run_one(first, prompt, PARAMS)[0] == plain(prompt)
    settle(first)
    assert first.cache.storage.backed_up_pages == (400 + PARAMS.max_tokens - 1) // PAGE
    second = l3_engine(long_llama, mooncake_master, closing, HostLayout.LAYER_FIRST)
    tokens, tiers = run_one(second, prompt, PARAMS)
    assert tokens == plain(prompt) and tiers.get("storage", 0) >= 0.9 * 400, tiers
    for engine in (first, second):  # only the small staging buffer is registered, never the pool
        stats, staging = engine.cache.storage.storage.stats(), engine.cache.storage.io.buffer
        registered = staging.untyped_storage().nbytes() + TRAILERS  # the staging pages with their trailer room
        assert stats["registered_buffers"] == 2 and stats["registered_bytes"] == registered
        assert staging.nbytes < engine.cache.host.buffer.nbytes


def test_a_master_killed_mid_run_degrades_to_l1_l2_then_l3_returns(long_llama: Path, plain, mooncake_master,
                                                                    closing, monkeypatch) -> None:
    monkeypatch.setattr(storage_tier, "RETRY_AFTER_S", 0.5)
    prompts = [prompt_of(10 + i, 320) for i in range(6)]
    writer = l3_engine(long_llama, mooncake_master, closing)
    assert run_one(writer, prompts[0], PARAMS)[0] == plain(prompts[0])
    settle(writer)  # prompts[0] is in L3: the next engine prefetches it
    engine = l3_engine(long_llama, mooncake_master, closing)
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(f"kill{i}", prompt, PARAMS)
    outputs: dict[str, list[int]] = {}
    for step in range(10_000):
        if step == 1:
            mooncake_master.kill()
        if not engine.has_work():
            break
        for out in engine.step():
            outputs[out.request_id] = outputs.get(out.request_id, []) + out.new_token_ids
    assert [outputs[f"kill{i}"] for i in range(4)] == [plain(p) for p in prompts[:4]]
    settle(engine)
    assert run_one(engine, prompts[4], PARAMS)[0] == plain(prompts[4])  # its backup fails or is skipped
    settle(engine)
    assert engine.cache.storage.failures >= 1

    mooncake_master.start()  # same port, empty store
    for client in (engine, writer):
        _wait_until_writable(client.cache.storage.storage)
    deadline = time.monotonic() + 10
    while not engine.cache.storage.healthy:  # the circuit breaker's retry window
        assert time.monotonic() < deadline
        time.sleep(0.05)
    backed_up = engine.cache.storage.backed_up_pages
    assert run_one(engine, prompts[5], PARAMS)[0] == plain(prompts[5])
    settle(engine)
    assert engine.cache.storage.backed_up_pages - backed_up == (320 + PARAMS.max_tokens - 1) // PAGE
    tokens, tiers = run_one(writer, prompts[5], PARAMS)  # the writer's client survived the restart too
    assert tokens == plain(prompts[5]) and tiers.get("storage", 0) >= 0.9 * 320, tiers
