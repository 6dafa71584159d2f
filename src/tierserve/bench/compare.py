"""Side by side: two reports' headline numbers and their ratio (b / a)."""

from __future__ import annotations

from typing import Any

from tierserve.bench.records import TIERS
from tierserve.bench.report import STATS, Report

# (label, path into the summary, unit scale, unit)
_LATENCIES = [(f"{name} {k}", (key, k), 1000.0, "ms") for name, key in
              (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")) for k in STATS]
METRICS: list[tuple[str, tuple[str, ...], float, str]] = [
    *_LATENCIES,
    ("requests/s", ("request_throughput",), 1.0, ""),
    ("input tok/s", ("input_token_throughput",), 1.0, ""),
    ("output tok/s", ("output_token_throughput",), 1.0, ""),
    ("hit rate", ("hit_rate",), 100.0, "%"),
    *[(f"hit rate {t}", ("hit_rate_by_tier", t), 100.0, "%") for t in TIERS],
    ("ideal hit rate", ("ideal_hit_rate",), 100.0, "%"),
    ("efficiency", ("efficiency",), 100.0, "%"),
    ("failed requests", ("requests", "failed"), 1.0, ""),
    ("goodput req/s", ("goodput", "goodput"), 1.0, ""),
]


def metric_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float | None, float | None, float | None]]:
    """(label, value in a, value in b, b / a) for every metric; None where a value is missing."""
    rows = []
    for label, path, scale, _ in METRICS:
        va, vb = _get(a, path), _get(b, path)
        va = None if va is None else va * scale
        vb = None if vb is None else vb * scale
        ratio = vb / va if va and vb is not None else None
        rows.append((label, va, vb, ratio))
    return rows


def compare(a: Report, b: Report, names: tuple[str, str] = ("a", "b")) -> str:
    """A text table of the two reports' metrics and the ratio b / a."""
    units = {label: unit for label, _, _, unit in METRICS}
    width = max(12, *(len(n) for n in names))
    lines = [f"{'metric':<18}{names[0]:>{width}}{names[1]:>{width}}{'b/a':>9}"]
    for label, va, vb, ratio in metric_rows(a.summary(), b.summary()):
        name = f"{label} ({units[label]})" if units[label] else label
        lines.append(f"{name:<18}{_num(va, width)}{_num(vb, width)}{_num(ratio, 9, '.2f')}")
    return "\n".join(lines)


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return None if value is None else float(value)


def _num(value: float | None, width: int, fmt: str = ".1f") -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"
