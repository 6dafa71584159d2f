"""One engine (no router, no disaggregation) as the API's backend, plus the engine's L3 admin
routes: what ``tierserve serve`` puts behind the HTTP layer. Torch-free: the engine arrives
already running on its own thread (``engine.loop.EngineLoop``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tierserve.api import openai as oa
from tierserve.api.admission import AdmissionPolicy, Lane, tracked
from tierserve.api.app import create_app
from tierserve.api.auth import admin_guard, check_admin_key
from tierserve.api.backend import Sibling
from tierserve.api.engine_metrics import EngineCollector
from tierserve.api.metrics import ApiMetrics
from tierserve.api.tenants import TenantKeys
from tierserve.api.tokenizer import TextTokenizer
from tierserve.core.outputs import RequestOutput
from tierserve.core.sampling import SamplingParams
from tierserve.core.scope import CacheScope
from tierserve.core.storage import StorageAction, StorageAdminError, StorageBusyError, StorageKind
from tierserve.core.test_hooks import refuse_test_switches
from tierserve.tracing import NO_TRACER, Tracer, current_span
from tierserve.tracing import attributes as at
from tierserve.tracing.engine_spans import ending, traced

if TYPE_CHECKING:
    from tierserve.engine.loop import EngineLoop


class EngineBackend:
    """One engine on its own thread (``EngineLoop``) as the API's backend."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.max_model_len = loop.engine.max_model_len
        self.lane = Lane()  # the engine's outstanding prompt work and prefill rate (``--admission ttft``)

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, scope: CacheScope,
                 *, buffered: bool = False, sibling: Sibling | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs as the engine makes them, ``buffered`` or not: one engine has nowhere else to
        retry, so holding them back would only delay them. ``sibling`` is ignored: the engine's
        in-flight sharing already computes a prompt's ``n`` choices' prompt once. Traced (a span is
        current, ``docs/tracing.md``): the engine's spans go under a ``tierserve.choice`` span."""
        outputs = tracked(self.lane, request_id, params.priority, len(prompt_ids),
                          self.loop.generate(request_id, prompt_ids, params, scope))
        parent = current_span()
        if not parent.recording:
            return outputs
        span = parent.child("tierserve.choice", attrs=at.request(request_id, scope.tenant, len(prompt_ids)))
        return ending(span, traced(span, outputs))

    def predict_ttft(self, prompt_ids: list[int], params: SamplingParams, scope: CacheScope) -> float | None:
        """The whole prompt counts (this side does not see the engine's cache: an over-estimate for
        a cached prefix)."""
        return self.lane.predict(params.priority, len(prompt_ids))

    def healthy(self) -> bool:
        """The engine thread runs and no step is overdue (several ranks: a frozen rank, docs/ranks.md)."""
        return self.loop.healthy

    def ready(self) -> bool:
        return self.loop.healthy

    async def debug_state(self) -> dict[str, Any]:
        """Occupancy as of the engine's last step (its published snapshot)."""
        return self.loop.stats() | {"loop_requests": self.loop.num_requests}


def create_engine_app(loop: EngineLoop, tokenizer: TextTokenizer | None, model_name: str,
                      keys: TenantKeys | None = None, admin_api_key: str | None = None,
                      admission: AdmissionPolicy = AdmissionPolicy.TTFT, tracer: Tracer = NO_TRACER) -> FastAPI:
    """The HTTP app for one started ``EngineLoop`` (the caller stops it), with ``/admin/storage``
    (L3 status, attach, detach, clear) behind ``admin_api_key``; API keys name tenants (``keys``);
    ``tracer``: each completion a trace (``docs/tracing.md``)."""
    check_admin_key(admin_api_key, keys)
    metrics = ApiMetrics(EngineCollector(loop))
    app = create_app(EngineBackend(loop), tokenizer, model_name, metrics, keys, admin_api_key, admission, tracer)
    admin = admin_guard(admin_api_key, keys)

    async def storage_status() -> Response:
        return JSONResponse(await loop.storage_admin(StorageAction.STATUS))

    async def storage_action(action: str, request: Request) -> Response:
        """attach (body: {"backend": NAME, "extra_config": {...}}), detach, clear: idle engine only,
        on every rank of the node at once; 502 when the store or a rank failed (no rank changed
        on a failed attach)."""
        verb, (backend, config) = _action(action), _storage_body(await request.body())
        try:
            status = await loop.storage_admin(verb, backend, config)
        except StorageBusyError as exc:
            raise oa.APIError(409, str(exc), code="busy") from None
        except ValueError as exc:
            raise oa.APIError(400, str(exc)) from None
        except StorageAdminError as exc:
            raise oa.APIError(502, str(exc), code="storage_failed") from None
        return JSONResponse(status)

    app.add_api_route("/admin/storage", storage_status, methods=["GET"], **admin)
    app.add_api_route("/admin/storage/{action}", storage_action, methods=["POST"], **admin)
    return app


def _action(name: str) -> StorageAction:
    try:
        return StorageAction.parse(name)
    except ValueError as exc:
        raise oa.APIError(400, str(exc), param="action") from None


def _storage_body(raw: bytes) -> tuple[StorageKind | None, dict[str, Any]]:
    try:
        body = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        raise oa.APIError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise oa.APIError(400, "the body must be a JSON object")
    return _kind(body.get("backend")), _extra_config(body.get("extra_config") or {})


def _extra_config(config: object) -> dict[str, Any]:
    """An attach's extra config: a JSON object without test-only switches (``core/test_hooks.py``)."""
    if not isinstance(config, dict):
        raise oa.APIError(400, "extra_config must be a JSON object", param="extra_config")
    try:
        refuse_test_switches(config)
    except ValueError as exc:
        raise oa.APIError(400, str(exc), param="extra_config") from None
    return config


def _kind(name: object) -> StorageKind | None:
    try:
        return None if name is None else StorageKind.parse(str(name))
    except ValueError as exc:
        raise oa.APIError(400, str(exc), param="backend") from None
