"""The Grafana dashboard's metric names, read out of its PromQL, and the names a ``/metrics`` text
exports, so a test can check the one against the other."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "components" / "dashboard" / \
    "tierserve-dashboard.json"
# What PromQL names besides metrics: aggregations, functions (followed by "(") and modifiers.
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and",
                      "or", "unless", "inf", "nan"})
# The samples a family of each type exports (a labelled family with no sample yet shows its type only).
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("", "_sum", "_count"), "untyped": ("",)}


def expressions(dashboard: dict) -> list[str]:
    """Every query of every panel (rows hold panels too)."""
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are not a function (followed by
    "("), a keyword, a label name (in ``{...}`` or a ``by``/``on``/``ignoring``/``group_*`` list),
    a range (``[...]``) or a string."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    return {m.group(1) for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", expr)
            if not m.group(2) and m.group(1).lower() not in KEYWORDS}


def dashboard_metrics(dashboard: dict) -> set[str]:
    return {name for expr in expressions(dashboard) for name in metric_names(expr)}


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def exported(text: str) -> set[str]:
    """Every sample name a ``/metrics`` text exports or declares (by its families' types)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names
