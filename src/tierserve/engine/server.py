"""``tierserve serve``: the OpenAI-compatible API in front of one engine (no router, no
disaggregation), plus the engine's L3 admin routes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tierserve import openai_api as oa
from tierserve.api_metrics import ApiMetrics
from tierserve.api_server import admin_guard, create_app, run_http
from tierserve.cache.hicache import StorageBusyError
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.loop import EngineLoop
from tierserve.engine.metrics import EngineCollector
from tierserve.engine.outputs import RequestOutput
from tierserve.engine.sampling_params import SamplingParams
from tierserve.model.tokenizer import TextTokenizer, try_load


class EngineBackend:
    """One engine on its own thread (``EngineLoop``) as the API's backend."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.max_model_len = loop.engine.max_model_len

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str
                 ) -> AsyncIterator[RequestOutput]:
        return self.loop.generate(request_id, prompt_ids, params, cache_salt=cache_salt)

    def healthy(self) -> bool:
        return self.loop.is_alive

    def ready(self) -> bool:
        return self.loop.is_alive

    async def debug_state(self) -> dict[str, Any]:
        """Occupancy, approximate: read without stopping the engine."""
        return self.loop.engine.stats() | {"loop_requests": self.loop.num_requests}


def create_engine_app(loop: EngineLoop, tokenizer: TextTokenizer | None, model_name: str,
                      api_key: str | None = None, admin_api_key: str | None = None) -> FastAPI:
    """The HTTP app for one started ``EngineLoop`` (the caller stops it), with ``/admin/storage``
    (L3 status, attach, detach, clear) behind ``admin_api_key``."""
    metrics = ApiMetrics(EngineCollector(loop.engine))
    app = create_app(EngineBackend(loop), tokenizer, model_name, metrics, api_key)
    admin = admin_guard(admin_api_key)

    async def storage_status() -> Response:
        return JSONResponse(await loop.call(lambda engine: engine.storage_admin("status")))

    async def storage_action(action: str, request: Request) -> Response:
        """attach (body: {"backend": NAME, "extra_config": {...}}), detach, clear: idle engine only."""
        backend, config = _storage_body(await request.body())
        try:
            status = await loop.call(lambda engine: engine.storage_admin(action, backend, config))
        except StorageBusyError as exc:
            raise oa.APIError(409, str(exc), code="busy") from None
        except ValueError as exc:
            raise oa.APIError(400, str(exc)) from None
        return JSONResponse(status)

    app.add_api_route("/admin/storage", storage_status, methods=["GET"], **admin)
    app.add_api_route("/admin/storage/{action}", storage_action, methods=["POST"], **admin)
    return app


def _storage_body(raw: bytes) -> tuple[str | None, dict[str, Any]]:
    try:
        body = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        raise oa.APIError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise oa.APIError(400, "the body must be a JSON object")
    return body.get("backend"), body.get("extra_config") or {}


def serve(config: EngineConfig, host: str, port: int, api_key: str | None, *,
          model_name: str | None = None, on_ready: Callable[[], None] | None = None,
          admin_api_key: str | None = None) -> None:
    """Loads the engine and serves it until SIGINT/SIGTERM, then stops the engine thread."""
    engine = Engine(config)
    loop = EngineLoop(engine).start()
    try:
        app = create_engine_app(loop, try_load(config.model_dir), model_name or engine.model_config.name, api_key,
                                admin_api_key)
        run_http(app, host, port, on_ready)
    finally:
        loop.stop()
