"""What a benchmark sends and what it measures: one ``RequestSpec`` in, one ``RequestRecord`` out.

Plain dataclasses with JSON round trips, so a report file can be read back without the
generators (``tierserve bench compare``, plotting scripts)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tierserve.core.tiers import TIERS

# A prompt is token ids (sent to /v1/completions), text (/v1/completions) or chat messages
# (/v1/chat/completions).
Prompt = list[int] | str | list[dict[str, str]]


@dataclass
class RequestSpec:
    """One request to send. ``tags`` label it for the report (``session``, ``round``, ``group``...);
    ``priority`` and ``deadline_ms`` (its class's, ``bench.classes``) are sent when set."""

    prompt: Prompt
    max_tokens: int
    tags: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None
    deadline_ms: int | None = None

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], dict)


@dataclass
class RequestRecord:
    """The measurements of one request. Times are seconds; ``*_at`` are offsets from the start
    of the run. ``ttft`` is the time from sending to the first streamed chunk that carries
    output (text or a finish reason); ``itl`` the gaps between later such chunks (a chunk may carry
    several tokens, as in SGLang's and vLLM's benchmarks). Token counts come from the server's
    usage; ``cached_by_tier`` from ``usage.cached_tokens_by_tier`` (zeros where a server gives none).
    ``ideal_cached_tokens`` is what an unbounded prefix cache would have hit (``bench.ideal``; None
    when the run could not know the prompt's token ids). A failed request has ``ok`` false and
    ``error`` set; its latencies may be missing."""

    index: int
    tags: dict[str, Any]
    scheduled_at: float
    sent_at: float = 0.0
    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    sent_prompt_tokens: int | None = None  # known when the prompt was token ids
    draft_tokens: int = 0  # speculative decoding (``usage.speculative``): drafts proposed and accepted
    accepted_tokens: int = 0
    ideal_cached_tokens: int | None = None  # filled after the run, once every prompt is known
    priority: int | None = None  # its class's (``bench.classes``); None: sent without
    deadline_ms: int | None = None  # its class's first-token deadline, also its SLO
    text: str = ""  # the answer; not written to JSON (it can be large, and multiturn needs it only live)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("text")
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
