"""The HTTP layer's answer to a bug: an exception nobody handled becomes an OpenAI-shaped 500,
counted in ``tierserve_http_errors_total`` like every other error (issue 13 item 9).

In process, over a backend whose ``generate`` raises what no layer expects: the fault injected
is the bug itself, which no real backend offers on demand."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from helpers.idle_backend import IdleBackend
from helpers.metrics import find, samples

from tierserve.api.app import create_app
from tierserve.api.metrics import ApiMetrics
from tierserve.core.outputs import RequestOutput
from tierserve.core.sampling import SamplingParams
from tierserve.core.scope import CacheScope

pytestmark = pytest.mark.fakes  # a backend that raises in place of an engine


class BuggyBackend(IdleBackend):
    """A backend with a bug: every request raises ``KeyError``."""

    max_model_len = 64

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, scope: CacheScope,
                       *, buffered: bool = False, sibling: object = None) -> AsyncIterator[RequestOutput]:
        raise KeyError("a bug")
        yield  # an async generator, as backends are


def _errors(metrics_text: str, status: str) -> float:
    return sum(s.value for s in samples(metrics_text)
               if s.name == "tierserve_http_errors_total" and s.labels["status"] == status)


async def _call() -> tuple[httpx.Response, str]:
    app = create_app(BuggyBackend(), None, "m", ApiMetrics())
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # Starlette re-raises after answering
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        reply = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        return reply, (await client.get("/metrics")).text


def test_an_unhandled_exception_is_an_openai_shaped_500_and_counted() -> None:
    reply, metrics = asyncio.run(_call())
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert error["type"] == "server_error" and "KeyError" in error["message"]
    assert _errors(metrics, "500") == 1
    assert find(metrics, "tierserve_http_errors_total", status="500", code="internal_error") == 1  # why, by code
