"""A base for the API tests' scripted backends: always healthy and ready, with no state to show;
a subclass says what ``generate`` yields (``tierserve.api.backend.Backend`` is the contract)."""

from __future__ import annotations

from typing import Any


class IdleBackend:
    """The parts of a backend an API test does not script."""

    def healthy(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    async def debug_state(self) -> dict[str, Any]:
        return {}

    def predict_ttft(self, prompt_ids: list[int], params: Any, scope: Any) -> float | None:
        return None
