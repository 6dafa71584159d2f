"""Runtime L3 attach / detach / status / clear: in the engine and through the admin HTTP API."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import run_one
from test_server import _start, _stop, _wait_healthy

from tierserve.cache.options import HiCacheOptions
from tierserve.core.sampling import SamplingParams
from tierserve.core.storage import StorageBusyError
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


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
    proc = _start(tiny_llama, tmp_path / "server.log", "--enable-hierarchical-cache", "--admin-api-key", "adm",
                  "--max-total-tokens", "512")
    url = f"http://127.0.0.1:{proc.port}"
    try:
        _wait_healthy(proc, url, tmp_path / "server.log")
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
        assert httpx.post(f"{url}/admin/storage/detach", headers=admin).json() == {"attached": False}
    finally:
        _stop(proc)


@pytest.mark.integration
def test_admin_api_is_off_without_a_key(tiny_llama: Path, tmp_path: Path) -> None:
    proc = _start(tiny_llama, tmp_path / "server.log", "--max-total-tokens", "512")
    url = f"http://127.0.0.1:{proc.port}"
    try:
        _wait_healthy(proc, url, tmp_path / "server.log")
        r = httpx.get(f"{url}/admin/storage")
        assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]
    finally:
        _stop(proc)
