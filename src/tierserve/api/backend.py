"""The ``Backend`` protocol: where the HTTP layer's requests run (one engine, or the router's
prefill/decode pairs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tierserve.core.outputs import RequestOutput
from tierserve.core.sampling import SamplingParams
from tierserve.core.scope import CacheScope


@dataclass(eq=False)
class Siblings:
    """The ``size`` choices of one prompt (``n`` > 1): one object the API gives each of them. Choice
    0 leads: a backend may compute the prompt once for it and run the others from its KV (the
    router does, ``docs/pd.md``, "n choices"). ``lead`` is where the backend tells the others,
    once, what the leader left them (a value only the backend reads; None: each goes its own way)."""

    size: int
    _lead: asyncio.Future[object] | None = field(default=None, repr=False)

    def lead(self) -> asyncio.Future[object]:
        """The leader's outcome, made on first use (on the running event loop)."""
        if self._lead is None:
            self._lead = asyncio.get_running_loop().create_future()
        return self._lead


@dataclass(frozen=True)
class Sibling:
    """Choice ``index`` of ``group`` (0: the leader)."""

    index: int
    group: Siblings


class Backend(Protocol):
    """Where API requests run. ``generate`` yields a request's outputs until the finished one and
    raises ``InvalidRequestError`` (400) or ``APIError`` (its status: 429 overloaded, 503 no
    healthy worker, 502 failed midway, ...) when it cannot serve it or cannot go on; closing the
    iterator early aborts the request.

    ``buffered``: the caller sends its client nothing before the request finished (a
    non-streaming response). The backend may then hold outputs back (even yield one output for
    the whole request) and, as no output can have reached the client, restart a request that
    failed midway. Without it every output may be with the client as soon as it is yielded, and
    the backend never takes one back.

    ``scope``: the API key's tenant and the client's ``cache_salt``; requests of different tenants
    never share cached KV, whatever their ``cache_salt`` (``core.scope.CacheScope``).

    ``sibling``: the request is one of a prompt's ``n`` choices (``Siblings``); a backend may ignore
    it (one engine: in-flight sharing already computes the prompt once, ``docs/cache.md``)."""

    max_model_len: int

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, scope: CacheScope,
                 *, buffered: bool = False, sibling: Sibling | None = None) -> AsyncIterator[RequestOutput]: ...

    def predict_ttft(self, prompt_ids: list[int], params: SamplingParams, scope: CacheScope) -> float | None:
        """Seconds until the request's first token if it were sent now, from the work ahead of it
        at its priority and the measured prefill rate (``api/admission.py``); None: no estimate yet."""
        ...

    def healthy(self) -> bool:
        """The process can serve (``/health``)."""
        ...

    def ready(self) -> bool:
        """Requests would be accepted now (``/readiness``): e.g. at least one healthy worker pair."""
        ...

    async def debug_state(self) -> dict[str, Any]:
        """Occupancy for tests and operators (``/debug/state``)."""
        ...
