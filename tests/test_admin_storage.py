"""Runtime L3 attach / detach / status / clear: in the engine and through the admin HTTP API, at TP 1
and on every rank of a TP 2 node."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from helpers.engine_runs import run_one
from helpers.injected_faults import node_env, write_faults
from helpers.metrics import scrape, value
from helpers.polling import poll, wait_for, wait_until
from helpers.processes import ServeProcess
from helpers.rank_hicache import seed as tp_seed
from helpers.rank_servers import complete, descendants, start_server, wait_exit, wait_gone
from helpers.tiny_models import add_word_tokenizer, make_tiny_model

from tierserve.cache.hashing import page_keys
from tierserve.cache.options import HiCacheOptions
from tierserve.cache.sharded.shards import HeadRange, object_key
from tierserve.core.sampling import SamplingParams
from tierserve.core.storage import StorageBusyError
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
STOPS_WITHIN_S = 15.0  # SIGTERM to exit, whatever L3 does (docs/faults.md)


def test_engine_attach_use_detach(tiny_llama: Path, tmp_path: Path) -> None:
    engine = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=16, max_total_tokens=512,
                                 enable_hierarchical_cache=True, hicache=HiCacheOptions(ratio=2.0)))
    assert engine.storage_admin("status") == {"attached": False}
    status = engine.storage_admin("attach", "file", {"path": str(tmp_path)})
    assert status["attached"] and status["backend"]["pages"] == 0
    with pytest.raises(StorageBusyError, match="already attached"):
        engine.storage_admin("attach", "file", {"path": str(tmp_path)})
    prompt = torch.randint(2, 384, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.add_request("busy", prompt, PARAMS)
    with pytest.raises(StorageBusyError, match="requests are running"):
        engine.storage_admin("detach")
    while engine.has_work():
        engine.step()
    run_one(engine, prompt[:50], PARAMS)
    engine.cache.wait_background()
    assert engine.storage_admin("status")["backend"]["pages"] > 0  # pages were backed up
    assert engine.storage_admin("clear")["backend"]["pages"] == 0
    assert engine.storage_admin("detach") == {"attached": False}
    with pytest.raises(StorageBusyError, match="no L3"):
        engine.storage_admin("detach")
    with pytest.raises(ValueError, match="unknown storage action"):
        engine.storage_admin("explode")


@pytest.mark.integration
def test_admin_routes(tiny_llama: Path, tmp_path: Path) -> None:
    server = ServeProcess(["--model", str(tiny_llama), "--enable-hierarchical-cache", "--admin-api-key", "adm",
                           "--max-total-tokens", "512"], tmp_path / "server.log")
    url = server.url
    try:
        server.wait_ready()
        admin = {"Authorization": "Bearer adm"}
        assert httpx.get(f"{url}/admin/storage").status_code == 401
        assert httpx.get(f"{url}/admin/storage", headers=admin).json() == {"attached": False}
        body = {"backend": "file", "extra_config": {"path": str(tmp_path / "l3")}}
        r = httpx.post(f"{url}/admin/storage/attach", headers=admin, json=body)
        assert r.status_code == 200 and r.json()["attached"]
        r = httpx.post(f"{url}/admin/storage/attach", headers=admin, json=body)
        assert r.status_code == 409 and "already attached" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/admin/storage/attach", headers=admin, content=b"{not json")
        assert r.status_code == 400
        for switch in ("fault_injection", "unsafe_skip_agreement"):  # test-only: never from a request
            test_only = {"backend": "file", "extra_config": {"path": str(tmp_path / "l3"), switch: {}}}
            r = httpx.post(f"{url}/admin/storage/attach", headers=admin, json=test_only)
            assert r.status_code == 400 and f"'{switch}' is a test-only switch" in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == "extra_config"
        assert httpx.post(f"{url}/admin/storage/detach", headers=admin).json() == {"attached": False}
    finally:
        server.stop()


@pytest.mark.integration
def test_admin_api_is_off_without_a_key(tiny_llama: Path, tmp_path: Path) -> None:
    server = ServeProcess(["--model", str(tiny_llama), "--max-total-tokens", "512"], tmp_path / "server.log")
    url = server.url
    try:
        server.wait_ready()
        r = httpx.get(f"{url}/admin/storage")
        assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]
    finally:
        server.stop()


ADMIN = {"Authorization": "Bearer adm"}


def _post(url: str, action: str, extra_config: dict | None = None) -> httpx.Response:
    body = {"backend": "file", "extra_config": extra_config} if extra_config is not None else None
    return httpx.post(f"{url}/admin/storage/{action}", headers=ADMIN, json=body, timeout=60)


def _when_idle(url: str, action: str) -> httpx.Response:
    """``action``'s answer once the node is idle (backups of the last answer may still run)."""
    return poll(lambda: _post(url, action), lambda r: not (r.status_code == 409 and "retry when" in r.text),
                f"{action} once idle", 30)


def _tp2_l3_names(model: Path, prompt: list[int]) -> set[str]:
    """The files both ranks of a TP 2 node write for the prompt's full pages (heads 0-1 and 2-3)."""
    keys = page_keys(tp_seed(model), prompt[: len(prompt) // 4 * 4], 4)
    return {f"{object_key(k, HeadRange(h, 2, 4)).hex()}.kv" for k in keys for h in (0, 2)}


@pytest.mark.integration
@pytest.mark.slow
def test_admin_routes_at_tp2_act_on_every_rank(tmp_path: Path) -> None:
    """Attach, detach and their failures through ``/admin/storage`` on a node of two ranks: a rank
    that cannot reach the store fails the whole attach and leaves no rank attached (the next
    attach, which a rank still attached would refuse, succeeds); once attached both ranks back
    up their heads; a detach detaches both. With a store whose writes never return, the node
    still stops within 15 s of SIGTERM (each rank abandons its L3 lanes, ``cache/lanes.py``)."""
    model = add_word_tokenizer(make_tiny_model("llama", tmp_path / "llama", heads=8, kv_heads=4))
    faults = write_faults(tmp_path / "faults.json")  # read again at each attach: rewritten below
    server = start_server(model, 2, tmp_path / "server.log", "--enable-hierarchical-cache",
                          "--admin-api-key", "adm", env=node_env(faults)).wait_healthy()
    l3 = {"path": str(tmp_path / "l3")}
    try:
        for failing in (1, 0):
            write_faults(faults, {"ranks": [failing], "unreachable": True})
            reply = _post(server.url, "attach", l3)
            assert reply.status_code == 502, reply.text
            assert f"rank {failing}: test fault" in reply.json()["error"]["message"]
            assert httpx.get(f"{server.url}/admin/storage", headers=ADMIN).json() == {"attached": False}
        write_faults(faults)
        assert _post(server.url, "attach", l3).json()["attached"]
        reply = _post(server.url, "attach", l3)
        assert reply.status_code == 409 and "rank 0: an L3 backend is already attached" in reply.text
        prompt = torch.randint(2, 384, (40,), generator=torch.Generator().manual_seed(5)).tolist()
        complete(server.client(), model.name, prompt)
        wanted = _tp2_l3_names(model, prompt)
        wait_until(lambda: wanted <= {p.name for p in (tmp_path / "l3").iterdir()}, "both ranks' backups", 30)
        assert _when_idle(server.url, "detach").json() == {"attached": False}
        reply = _post(server.url, "detach")
        assert reply.status_code == 409 and "no L3 backend is attached" in reply.text
        write_faults(faults, {"ranks": [0, 1], "hang_writes": True})  # the next attach's store never answers a write
        assert _post(server.url, "attach", l3).json()["attached"]  # no rank kept the detached one
        complete(server.client(), model.name, prompt[::-1])  # a new prompt: its backups hang on both ranks
        wait_for(lambda: value(scrape(server.url), "tierserve_cache_l3_backups_in_flight") >= 1, "a hung backup", 30)
        processes = descendants(server.proc.pid)
        server.proc.terminate()
        assert wait_exit(server.proc, STOPS_WITHIN_S) == 0, server.log.read_text()[-3000:]
        assert wait_gone(processes, 5) == []
    finally:
        server.stop()
    assert server.log.read_text().count("abandoning the L3 lanes") == 2  # rank 0 and rank 1
