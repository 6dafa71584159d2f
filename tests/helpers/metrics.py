"""Prometheus ``/metrics`` as the tests read it: one sample by name and labels, or a family of
gauges by prefix."""

from __future__ import annotations

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def scrape(url: str) -> str:
    """The ``/metrics`` text served at ``url`` (a server's base URL)."""
    return httpx.get(f"{url}/metrics", timeout=10).text


def samples(text: str) -> list[Sample]:
    """Every sample of a ``/metrics`` text."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def find(text: str, name: str, **labels: str) -> float | None:
    """The first sample named ``name`` whose labels include ``labels``; ``None`` while it is absent."""
    for sample in samples(text):
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return None


def value(text: str, name: str, **labels: str) -> float:
    """``find``'s sample, 0 while it has not appeared (a counter nothing has counted yet)."""
    found = find(text, name, **labels)
    return 0.0 if found is None else found


def by_suffix(text: str, prefix: str, suffix: str = "") -> dict[str, float]:
    """The unlabelled samples ``<prefix><key><suffix>``, by key: a family of gauges or counters."""
    found = re.findall(rf"^{prefix}(\w+){suffix} (\S+)$", text, re.MULTILINE)
    return {k: float(v) for k, v in found}
