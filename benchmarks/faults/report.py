"""``benchmarks/RELIABILITY.md`` from the campaign's rows: one table of counts, then what each
experiment noted, then the raw rows as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from faults.experiments import Row


def _held(row: Row) -> str:
    if not row.held_pages:
        return "0"
    if row.quarantine_freed_s is not None:
        pages = sum(h["quarantined"] for h in row.held_pages.values())
        return f"0 (+{pages:g} quarantined, all freed {row.quarantine_freed_s:.0f} s after)"
    return "; ".join(f"{node}: {', '.join(f'{k} {v:g}' for k, v in held.items())}"
                     for node, held in sorted(row.held_pages.items()))


def _failed(row: Row) -> str:
    return ", ".join(f"{k} ×{v}" for k, v in sorted(row.failed.items())) or "0"


def table(rows: list[Row]) -> list[str]:
    lines = ["| experiment | sent | succeeded | failed (kind, status) | wrong outputs | held 10 s after "
             "| RSS growth (MB) | recovery (s) |", "|---|---:|---:|---|---:|---|---:|---:|"]
    for r in rows:
        recovery = "" if r.recovery_s is None else f"{r.recovery_s:.1f}"
        lines.append(f"| {r.name} | {r.sent} | {r.ok} | {_failed(r)} | {r.wrong} | {_held(r)} "
                     f"| {r.rss_growth_mb:+.0f} | {recovery} |")
    return lines


def write(path: Path, rows: list[Row], command: str, preamble: list[str]) -> None:
    notes = [f"- **{r.name}**: {'; '.join(r.notes)}" for r in rows if r.notes]
    text = ["# Reliability campaign (issue 13)", "", "```bash", command, "```", "", *preamble, "", *table(rows), "",
            *notes, "", "<details><summary>raw rows</summary>", "", "```json",
            json.dumps([asdict(r) for r in rows], indent=1), "```", "", "</details>", ""]
    path.write_text("\n".join(text))
