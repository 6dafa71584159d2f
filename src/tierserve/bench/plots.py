"""PNG plots of one or several labelled reports: the TTFT CDF, and the hit rate per round
(multi-turn runs) or over time. matplotlib is optional: ``save_plots`` returns no paths and says why
when it is missing, instead of failing a benchmark whose numbers are already in hand."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

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


def save_plots(report: Report, out_dir: Path, stem: str, label: str = "run") -> list[Path]:
    """``<stem>_ttft_cdf.png`` and ``<stem>_hit_rate.png`` in ``out_dir``; [] without matplotlib."""
    if _pyplot() is None:
        log.warning("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = {label: report}
    return [plot_ttft_cdf(reports, out_dir / f"{stem}_ttft_cdf.png"),
            plot_hit_rate(reports, out_dir / f"{stem}_hit_rate.png")]


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
