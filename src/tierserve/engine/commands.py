"""What reaches an engine from outside, as data: every rank of a node applies the same commands in
the same order (``docs/architecture.md``, Ranks), so they must cross processes (pickled)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tierserve.core.sampling import SamplingParams
from tierserve.engine.engine import Engine
from tierserve.engine.handoff import Handoff
from tierserve.engine.request import RequestOutput


class EngineCommand(Protocol):
    """A change to the engine's requests. ``apply`` runs on the engine thread of every rank and may
    produce the request's first output; it raises for a request that can never be served."""

    request_id: str

    def apply(self, engine: Engine) -> RequestOutput | None: ...


@dataclass(frozen=True)
class AddRequest:
    """``Engine.add_request``. A ``handoff`` is this process's own object: it never crosses ranks."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str = ""
    handoff: Handoff | None = None

    def apply(self, engine: Engine) -> RequestOutput | None:
        engine.add_request(self.request_id, self.prompt_ids, self.params, self.cache_salt, self.handoff)
        return None


@dataclass(frozen=True)
class StartReserved:
    """``Engine.start_reserved``: a reservation whose prompt KV arrived starts decoding."""

    request_id: str
    first_token: int
    params: SamplingParams

    def apply(self, engine: Engine) -> RequestOutput | None:
        return engine.start_reserved(self.request_id, self.first_token, self.params)


@dataclass(frozen=True)
class AbortRequest:
    """``Engine.abort``: stops a waiting or running request (nothing if it is gone)."""

    request_id: str

    def apply(self, engine: Engine) -> RequestOutput | None:
        return engine.abort(self.request_id)
