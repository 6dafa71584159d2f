"""PNG plots of one or several labelled reports: the TTFT CDF, and the hit rate per round
(multi-turn runs) or over time. matplotlib is optional: ``save_plots`` returns no paths and says why
when it is missing, instead of failing a benchmark whose numbers are already in hand."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tierserve.bench.records import TIERS
from tierserve.bench.report import Report

log = logging.getLogger(__name__)


def _pyplot() -> Any | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(reports: dict[str, Report], path: Path) -> Path:
    """One CDF line of TTFT (ms) per report."""
    plt = _require()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, report in reports.items():
        values = sorted(r.ttft * 1000 for r in report.ok if r.ttft is not None)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_hit_rate(reports: dict[str, Report], path: Path, bins: int = 20) -> Path:
    """Hit rate per round when every report has rounds, else over time (bins of send time)."""
    plt = _require()
    fig, ax = plt.subplots(figsize=(6, 4))
    by_round = all(r.hit_rate_by_round() for r in reports.values())
    for label, report in reports.items():
        if by_round:
            points = [(float(k), v) for k, v in report.hit_rate_by_round().items() if v is not None]
        else:
            points = [(t, v) for t, v in report.hit_rate_over_time(bins) if v is not None]
        if points:
            ax.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o", label=label)
    if by_round:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="round" if by_round else "send time (s)", ylabel="hit rate (% of prompt tokens)",
           title="prefix cache hit rate", ylim=(0, 102))
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_server_view(report: Report, path: Path) -> Path:
    """The client's figures beside the servers' (``--scrape-metrics``): hit rate by tier, and the
    median TTFT and E2E with the servers' mean queue and handoff times."""
    plt = _require()
    client, server = report.summary(), report.server or {}
    fig, (rates, times) = plt.subplots(1, 2, figsize=(10, 4))
    tiers = list(TIERS)
    for i, (label, by_tier) in enumerate((("client", client["hit_rate_by_tier"]),
                                          ("server", server.get("hit_rate_by_tier", {})))):
        rates.bar([t + i * 0.4 for t in range(len(tiers))], [100 * (by_tier.get(t) or 0) for t in tiers], 0.4,
                  label=label)
    rates.set(xticks=[t + 0.2 for t in range(len(tiers))], xticklabels=tiers, ylabel="% of prompt tokens",
              title="hit rate by tier")
    bars = {"TTFT p50 client": client["ttft_s"]["median"], "TTFT p50 server": _get(server, "ttft_s", "p50"),
            "E2E p50 client": client["e2e_s"]["median"], "E2E p50 server": _get(server, "e2e_s", "p50"),
            "node queue mean": _get(server, "queue_s", "mean"), "handoff mean": _get(server, "handoff_s", "mean"),
            "handoff exposed mean": _get(server, "handoff_exposed_s", "mean")}
    times.barh(list(bars), [1000 * (v or 0) for v in bars.values()],
               color=["C0" if "client" in k else "C1" for k in bars])
    times.invert_yaxis()
    times.set(xlabel="ms", title="latency: client and servers")
    for ax in (rates, times):
        ax.grid(alpha=0.3)
    rates.legend()
    return _save(fig, path)


def _get(server: dict[str, Any], key: str, stat: str) -> float | None:
    return (server.get(key) or {}).get(stat)


def save_plots(report: Report, out_dir: Path, stem: str, label: str = "run") -> list[Path]:
    """``<stem>_ttft_cdf.png`` and ``<stem>_hit_rate.png`` in ``out_dir``, and ``<stem>_server.png``
    when the report has the servers' view; [] without matplotlib."""
    if _pyplot() is None:
        log.warning("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = {label: report}
    paths = [plot_ttft_cdf(reports, out_dir / f"{stem}_ttft_cdf.png"),
             plot_hit_rate(reports, out_dir / f"{stem}_hit_rate.png")]
    if report.server and "error" not in report.server:
        paths.append(plot_server_view(report, out_dir / f"{stem}_server.png"))
    return paths


def _require() -> Any:
    plt = _pyplot()
    if plt is None:
        raise RuntimeError("plots need matplotlib (pip install matplotlib)")
    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
