"""The servers' own view of a run (``bench run --scrape-metrics``): the Prometheus ``/metrics`` of
the router (or ``serve``) and of the nodes, read before and after the run; the figures come from
the difference, summed over every server read.

Contract of ``server_figures`` (the report's ``server`` object; None where there is no sample):
``sources`` (the URLs read); ``requests``, ``prompt_tokens``, ``cached_tokens`` {device, host,
storage} and ``prefill_tokens_computed`` (counts); ``hit_rate`` and ``hit_rate_by_tier`` (the
API's cached / prompt tokens, as the client's); ``ttft_s``, ``itl_s``, ``e2e_s`` (the API's
histograms), ``handoff_s`` and ``handoff_exposed_s`` (prefill nodes: first KV submission to last
completion, and the part after the prompt's compute) as {count, mean, p50, p90, p99}, percentiles
interpolated within Prometheus buckets as ``histogram_quantile`` does; ``queue_s`` {admitted,
mean} (nodes: arrival to first admission); ``handoff_bytes``, ``l3_write_bytes``, ``l3_read_bytes``,
``preemptions``, ``migrations``, ``retries``; ``http_errors`` {status: count}."""

from __future__ import annotations

import math
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tierserve.bench.records import TIERS

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]  # (sample name, sorted labels) -> value
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


class ScrapeError(Exception):
    """A ``/metrics`` URL that did not answer with Prometheus text."""


def metrics_url(endpoint: str) -> str:
    """The ``/metrics`` of an API server's root URL."""
    return endpoint.rstrip("/") + "/metrics"


def parse(text: str) -> Samples:
    """Every sample of a ``/metrics`` text but the ``_created`` timestamps."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


async def scrape(client: httpx.AsyncClient, urls: list[str]) -> dict[str, Samples]:
    """Each URL's samples; ``ScrapeError`` naming the first that failed."""
    out = {}
    for url in urls:
        try:
            response = await client.get(url, timeout=10)
            response.raise_for_status()
            out[url] = parse(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            raise ScrapeError(f"cannot read {url}: {type(exc).__name__}: {exc}") from None
    return out


def difference(before: dict[str, Samples], after: dict[str, Samples]) -> Samples:
    """After minus before, per sample, summed over the servers (a sample new after the run counts
    from 0; a server restarted during it can make a difference negative)."""
    out: Samples = {}
    for url, samples in after.items():
        old = before.get(url, {})
        for key, value in samples.items():
            out[key] = out.get(key, 0.0) + value - old.get(key, 0.0)
    return out


def total(d: Samples, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in d.items() if n == name and all((k, x) in ls for k, x in labels.items()))


def by_label(d: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, ls), v in d.items():
        if n == name and (value := dict(ls).get(label)) is not None:
            out[value] = out.get(value, 0.0) + v
    return out


def histogram(d: Samples, name: str) -> dict[str, float | None]:
    """Count, mean and interpolated percentiles of a histogram's difference."""
    count = total(d, f"{name}_count")
    buckets = sorted((float(le), n) for le, n in by_label(d, f"{name}_bucket", "le").items())
    if count <= 0:
        return {"count": 0, "mean": None, **dict.fromkeys(QUANTILES)}
    return {"count": int(count), "mean": total(d, f"{name}_sum") / count,
            **{k: quantile(buckets, q) for k, q in QUANTILES.items()}}


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """``histogram_quantile``: the q-quantile of cumulative ``(le, count)`` buckets, linear within a
    bucket; the highest finite bound when it falls in the +Inf bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, low, below = q * buckets[-1][1], 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return low
            return le if n == below else low + (le - low) * (rank - below) / (n - below)
        low, below = le, n
    return low


def server_figures(before: dict[str, Samples], after: dict[str, Samples]) -> dict[str, Any]:
    d = difference(before, after)
    prompt = total(d, "tierserve_prompt_tokens_total")
    cached = {t: total(d, "tierserve_cached_tokens_total", tier=t) for t in TIERS}
    admitted = total(d, "tierserve_admitted_requests_total")
    return {
        "sources": sorted(after),
        "requests": total(d, "tierserve_requests_total"), "prompt_tokens": prompt, "cached_tokens": cached,
        "prefill_tokens_computed": total(d, "tierserve_prefill_tokens_computed_total"),
        "hit_rate": sum(cached.values()) / prompt if prompt > 0 else None,
        "hit_rate_by_tier": {t: n / prompt if prompt > 0 else None for t, n in cached.items()},
        "ttft_s": histogram(d, "tierserve_time_to_first_token_seconds"),
        "itl_s": histogram(d, "tierserve_inter_token_latency_seconds"),
        "e2e_s": histogram(d, "tierserve_e2e_request_latency_seconds"),
        "queue_s": {"admitted": int(admitted),
                    "mean": total(d, "tierserve_queue_seconds_total") / admitted if admitted > 0 else None},
        "handoff_s": histogram(d, "tierserve_transfer_seconds"),
        "handoff_exposed_s": histogram(d, "tierserve_transfer_exposed_seconds"),
        "handoff_bytes": total(d, "tierserve_transfer_bytes_total"),
        "l3_write_bytes": total(d, "tierserve_cache_l3_backup_bytes_total"),
        "l3_read_bytes": total(d, "tierserve_cache_l3_prefetch_bytes_total"),
        "preemptions": total(d, "tierserve_preemptions_total"),
        "migrations": total(d, "tierserve_router_migrations_total"),
        "retries": total(d, "tierserve_router_retries_total"),
        "http_errors": by_label(d, "tierserve_http_errors_total", "status"),
    }


def server_lines(s: dict[str, Any]) -> list[str]:
    """The report table's lines for the servers' view (latencies in milliseconds)."""
    if "error" in s:
        return [f"server view: - ({s['error']})"]
    tiers = ", ".join(f"{t} {_pct(s['hit_rate_by_tier'][t])}" for t in TIERS)
    lines = [f"server view ({len(s['sources'])} /metrics, after - before): {s['requests']:.0f} requests",
             f"  hit rate: {_pct(s['hit_rate'])} of {s['prompt_tokens']:.0f} prompt tokens ({tiers})",
             f"  {'(ms; from buckets)':<21}" + "".join(f"{k:>10}" for k in ("mean", "p50", "p90", "p99"))]
    for label, key in (("TTFT", "ttft_s"), ("E2E", "e2e_s"), ("handoff", "handoff_s"),
                       ("handoff exposed", "handoff_exposed_s")):
        h = s[key]
        lines.append(f"  {label + ' (ms)':<21}" + "".join(_ms(h[k]) for k in ("mean", "p50", "p90", "p99"))
                     + f"   over {h['count']}")
    q = s["queue_s"]
    lines.append(f"  node queue: mean {_ms(q['mean']).strip()} ms over {q['admitted']} admissions; handoff "
                 f"{s['handoff_bytes'] / 1e6:.2f} MB; L3 write {s['l3_write_bytes'] / 1e6:.2f} MB, read "
                 f"{s['l3_read_bytes'] / 1e6:.2f} MB; prefill computed {s['prefill_tokens_computed']:.0f} tokens")
    return lines


def _ms(value: float | None) -> str:
    return f"{'-':>10}" if value is None else f"{value * 1000:>10.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
