"""Request classes (``tierserve bench run --class PRIORITY:SHARE[:DEADLINE_MS]``) and goodput.

A class is a share of the sessions, sent with its ``priority`` (the request body's, lower is more
important) and, if it has one, its first-token deadline (the ``x-request-deadline-ms`` header),
which is also its SLO. Each session gets one class, drawn from the seed, so the same seed gives
the same mix whatever the run's timing. **Goodput** is the requests that finished within their
SLO (ok, and a TTFT within the deadline when their class has one) per second of the run; a
request shed with 429 or timed out never counts."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tierserve.bench.records import RequestRecord


@dataclass(frozen=True)
class RequestClass:
    priority: int
    share: float
    deadline_ms: int | None = None

    @classmethod
    def parse(cls, text: str) -> RequestClass:
        """``PRIORITY:SHARE[:DEADLINE_MS]``, e.g. ``0:0.3:2000``; ``ValueError`` saying what is wrong."""
        parts = text.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError("give PRIORITY:SHARE or PRIORITY:SHARE:DEADLINE_MS")
            deadline = int(parts[2]) if len(parts) == 3 else None
            klass = cls(int(parts[0]), float(parts[1]), deadline)
        except ValueError as exc:
            raise ValueError(f"--class {text!r}: {exc}") from None
        if not klass.share > 0 or (deadline is not None and deadline < 1):
            raise ValueError(f"--class {text!r}: the share must be above 0 and a deadline at least 1 ms")
        return klass


def assign(classes: tuple[RequestClass, ...], sessions: int, seed: int) -> list[RequestClass | None]:
    """Each session's class, drawn by share (None for every session when there are no classes)."""
    if not classes:
        return [None] * sessions
    rng = random.Random(f"{seed}:classes")
    return rng.choices(list(classes), weights=[c.share for c in classes], k=sessions)


def within_slo(record: RequestRecord) -> bool:
    """Finished, and (with a deadline) its first token within it."""
    if not record.ok:
        return False
    return record.deadline_ms is None or (record.ttft is not None and record.ttft * 1000 <= record.deadline_ms)


def goodput(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    """Requests within their SLO per second, with the counts behind it: ``good``, ``shed`` (429),
    ``late`` (finished past the deadline), ``failed`` (other failures)."""
    span = max(duration, 1e-9)
    good = sum(within_slo(r) for r in records)
    shed = sum(r.status == 429 for r in records)
    late = sum(r.ok and not within_slo(r) for r in records)
    failed = sum(not r.ok for r in records) - shed
    return {"requests": len(records), "good": good, "goodput": good / span, "shed": shed, "late": late,
            "failed": failed}
