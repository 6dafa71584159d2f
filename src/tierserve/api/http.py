"""Serving an app with uvicorn on uvloop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from tierserve.core.gc_heap import freeze_startup_heap

# Longer than the 5 s for which httpx (so the openai SDK) and aiohttp keep an idle connection pooled:
# with uvicorn's own 5 s both sides expire it at once, and a request sent on it as the server closes
# it is lost ("Server disconnected without sending a response"). nginx keeps 75 s.
KEEP_ALIVE_S = 75


class _Uvicorn(uvicorn.Server):
    """uvicorn that calls ``on_ready`` once its socket is listening."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_ready = on_ready

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.started:
            return
        freeze_startup_heap()  # before the first request (docs/architecture.md, the collector)
        if self._on_ready is not None:
            self._on_ready()


def run_http(app: FastAPI, host: str, port: int, on_ready: Callable[[], None] | None = None) -> None:
    """Serves ``app`` with uvicorn on uvloop until SIGINT/SIGTERM."""
    uv_config = uvicorn.Config(app, host=host, port=port, loop="uvloop", log_config=None,
                               timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S)
    _Uvicorn(uv_config, on_ready).run()
