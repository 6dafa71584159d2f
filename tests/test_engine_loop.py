"""The engine thread and the threads that read it: other threads see the engine's occupancy only
as a snapshot the engine thread published (a scrape never walks the tree while a step changes it)."""

from __future__ import annotations

import threading
from pathlib import Path

from fastapi.testclient import TestClient

from tierserve.api.engine_backend import create_engine_app
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.loop import EngineLoop


def test_metrics_and_debug_state_read_the_engine_threads_snapshot(tiny_llama: Path) -> None:
    engine = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=16, max_total_tokens=512))
    loop = EngineLoop(engine)
    callers: list[str] = []
    real = engine.stats

    def recording() -> dict[str, float]:
        callers.append(threading.current_thread().name)
        return real()

    engine.stats = recording  # type: ignore[method-assign]
    loop.start()
    try:
        with TestClient(create_engine_app(loop, None, "tiny")) as client:
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
            metrics = client.get("/metrics").text
            state = client.get("/debug/state").json()
    finally:
        loop.stop()
    assert "tierserve_kv_pages_total 32.0" in metrics and state["kv_pages_total"] == 32
    assert callers and set(callers) == {"engine"}, f"Engine.stats ran on {sorted(set(callers))}"
