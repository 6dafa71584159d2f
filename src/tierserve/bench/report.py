"""The result of a run: every request's record, the summary, the table, JSON and comparison.

Contract of ``Report.summary()`` (also the ``summary`` object of the JSON file):
``requests`` {total, ok, failed}, ``errors`` {message: count}, ``duration_s``;
``ttft_s``/``itl_s``/``e2e_s`` {mean, median, p90, p99, count} over successful requests (None
where there is no sample); ``request_throughput`` (successful requests/s),
``input_token_throughput``/``output_token_throughput`` (tokens/s); ``tokens`` {prompt, output,
cached, device, host, storage}; ``hit_rate`` = cached / prompt tokens and ``hit_rate_by_tier``
{device, host, storage} = that tier's cached / prompt tokens (they sum to ``hit_rate`` when the
server's tiers sum to its cached tokens); ``hit_rate_by_round`` {round: rate} for multi-turn runs;
``ideal_hit_rate`` = the ideal cached tokens (an unbounded prefix cache over the prompts the run
sent, ``bench.ideal``) / prompt tokens, and ``efficiency`` = ``hit_rate`` / ``ideal_hit_rate``, both
over the successful requests (None where the ideal is unknown, or 0 for ``efficiency``);
``tokens.ideal_cached`` is the numerator (None where unknown); ``server``: the servers' own figures
over the run (``bench.server_metrics``; None without ``--scrape-metrics``)."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierserve.bench.classes import goodput
from tierserve.bench.records import TIERS, RequestRecord
from tierserve.bench.server_metrics import server_lines

STATS = ("mean", "median", "p90", "p99")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, **dict.fromkeys(STATS)}
    return {"count": len(values), "mean": sum(values) / len(values), "median": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99)}


def ideal_hit_rate(records: list[RequestRecord]) -> float | None:
    """Ideal cached / prompt tokens over ``records`` (pass the successful ones, as for
    ``hit_rates``); None without prompt tokens or when a record's ideal is unknown."""
    prompt = sum(r.prompt_tokens for r in records)
    ideal = [r.ideal_cached_tokens for r in records]
    if not prompt or None in ideal:
        return None
    return sum(x for x in ideal if x is not None) / prompt


def efficiency(achieved: float | None, ideal: float | None) -> float | None:
    """``achieved`` / ``ideal`` hit rate; None when either is unknown or the ideal is 0 (a run with
    nothing to reuse has no efficiency to speak of)."""
    return achieved / ideal if achieved is not None and ideal else None


def hit_rates(records: list[RequestRecord]) -> tuple[float | None, dict[str, float | None]]:
    """Cached / prompt tokens over ``records``, overall and per tier (None without prompt tokens)."""
    prompt = sum(r.prompt_tokens for r in records)
    if not prompt:
        return None, dict.fromkeys(TIERS)
    by_tier = {t: sum(r.cached_by_tier.get(t, 0) for r in records) / prompt for t in TIERS}
    return sum(r.cached_tokens for r in records) / prompt, by_tier


@dataclass
class Report:
    """``records`` in send order, the run's wall ``duration`` and ``meta`` (endpoint, workload,
    options); ``server``: the servers' view (``server_metrics.server_figures``, or {"error": why}),
    None when not asked for."""

    records: list[RequestRecord]
    duration: float
    meta: dict[str, Any]
    server: dict[str, Any] | None = None

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    def summary(self) -> dict[str, Any]:
        ok, span = self.ok, max(self.duration, 1e-9)
        rate, by_tier = hit_rates(ok)
        tokens = {"prompt": sum(r.prompt_tokens for r in ok), "output": sum(r.output_tokens for r in ok),
                  "cached": sum(r.cached_tokens for r in ok),
                  **{t: sum(r.cached_by_tier.get(t, 0) for r in ok) for t in TIERS},
                  "ideal_cached": _ideal_cached(ok)}
        ideal = ideal_hit_rate(ok)
        return {
            "requests": {"total": len(self.records), "ok": len(ok), "failed": len(self.records) - len(ok)},
            "errors": dict(Counter(r.error for r in self.records if r.error).most_common()),
            "duration_s": self.duration,
            "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
            "itl_s": distribution([x for r in ok for x in r.itl]),
            "e2e_s": distribution([r.e2e for r in ok if r.e2e is not None]),
            "request_throughput": len(ok) / span,
            "input_token_throughput": tokens["prompt"] / span,
            "output_token_throughput": tokens["output"] / span,
            "tokens": tokens,
            "hit_rate": rate,
            "hit_rate_by_tier": by_tier,
            "hit_rate_by_round": self.hit_rate_by_round(),
            "ideal_hit_rate": ideal,
            "efficiency": efficiency(rate, ideal),
            "speculative": speculative(ok),
            "server": self.server,
            "goodput": goodput(self.records, self.duration),
            "by_priority": self.by_priority(),
        }

    def by_priority(self) -> dict[int, dict[str, Any]]:
        """Per priority class (empty when no request had one): goodput's counts, and the TTFT of
        its successful requests."""
        classes = sorted({r.priority for r in self.records if r.priority is not None})
        out = {}
        for p in classes:
            records = [r for r in self.records if r.priority == p]
            ttft = distribution([r.ttft for r in records if r.ok and r.ttft is not None])
            out[p] = goodput(records, self.duration) | {"deadline_ms": records[0].deadline_ms, "ttft_s": ttft}
        return out

    def hit_rate_by_round(self) -> dict[int, float | None]:
        """Hit rate of the successful requests of each round (empty when no record has a round)."""
        rounds = sorted({r.tags["round"] for r in self.ok if "round" in r.tags})
        return {k: hit_rates([r for r in self.ok if r.tags.get("round") == k])[0] for k in rounds}

    def hit_rate_over_time(self, bins: int = 20) -> list[tuple[float, float | None]]:
        """(bin start in seconds, hit rate of the successful requests sent in that bin)."""
        ok = self.ok
        if not ok:
            return []
        width = max(max(r.sent_at for r in ok) / bins, 1e-9)
        groups: dict[int, list[RequestRecord]] = {}
        for r in ok:
            groups.setdefault(min(int(r.sent_at / width), bins - 1), []).append(r)
        return [(k * width, hit_rates(groups[k])[0]) for k in sorted(groups)]

    def table(self) -> str:
        """The summary as aligned text lines (latencies in milliseconds)."""
        return format_table(self.summary(), self.meta)

    def to_json(self, path: Path | str) -> None:
        data = {"meta": self.meta, "duration_s": self.duration, "summary": self.summary(), "server": self.server,
                "records": [r.to_json() for r in self.records]}
        Path(path).write_text(json.dumps(data, indent=1))

    @classmethod
    def from_json(cls, path: Path | str) -> Report:
        data = json.loads(Path(path).read_text())
        return cls([RequestRecord.from_json(r) for r in data["records"]], data["duration_s"], data["meta"],
                   data.get("server"))


def format_table(s: dict[str, Any], meta: dict[str, Any]) -> str:
    req = s["requests"]
    lines = [f"workload {meta.get('workload')} against {meta.get('endpoint')} (model {meta.get('model')})",
             f"requests: {req['ok']} ok, {req['failed']} failed, of {req['total']} in {s['duration_s']:.2f} s"]
    lines += [f"  error x{n}: {msg}" for msg, n in list(s["errors"].items())[:5]]
    lines.append(f"{'latency (ms)':<14}" + "".join(f"{k:>10}" for k in STATS))
    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")):
        lines.append(f"{name:<14}" + "".join(_ms(s[key][k]) for k in STATS))
    lines.append(f"throughput: {s['request_throughput']:.2f} req/s, {s['input_token_throughput']:.1f} input "
                 f"tok/s, {s['output_token_throughput']:.1f} output tok/s")
    tiers = ", ".join(f"{t} {_pct(s['hit_rate_by_tier'][t])}" for t in TIERS)
    lines.append(f"hit rate: {_pct(s['hit_rate'])} of {s['tokens']['prompt']} prompt tokens ({tiers})")
    lines.append(_ideal_line(s, meta.get("ideal") or {}))
    if s["hit_rate_by_round"]:
        lines.append("by round: " + ", ".join(f"{k}: {_pct(v)}" for k, v in s["hit_rate_by_round"].items()))
    lines += _goodput_lines(s)
    if s.get("speculative"):
        spec = s["speculative"]
        lines.append(f"speculative: {_pct(spec['acceptance_rate'])} of {spec['draft_tokens']} draft tokens accepted")
    if s.get("server"):
        lines += server_lines(s["server"])
    return "\n".join(lines)


def _goodput_lines(s: dict[str, Any]) -> list[str]:
    """Goodput, and one line per priority class when the run had classes."""
    g = s.get("goodput")
    if g is None:
        return []
    lines = [f"goodput: {g['goodput']:.2f} req/s within SLO ({g['good']} of {g['requests']}; shed {g['shed']}, "
             f"late {g['late']}, failed {g['failed']})"]
    for p, c in (s.get("by_priority") or {}).items():
        deadline = f"{c['deadline_ms']} ms" if c["deadline_ms"] is not None else "none"
        lines.append(f"  priority {p} (deadline {deadline}): goodput {c['goodput']:.2f} req/s, {c['good']} of "
                     f"{c['requests']} good, shed {c['shed']}, late {c['late']}, failed {c['failed']}; TTFT p50 "
                     f"{_ms(c['ttft_s']['median']).strip()} ms, p99 {_ms(c['ttft_s']['p99']).strip()} ms")
    return lines


def speculative(records: list[RequestRecord]) -> dict[str, Any] | None:
    """Draft tokens proposed and accepted over ``records`` and the acceptance rate; None when the
    server proposed none (no draft model)."""
    drafted = sum(r.draft_tokens for r in records)
    if not drafted:
        return None
    accepted = sum(r.accepted_tokens for r in records)
    return {"draft_tokens": drafted, "accepted_tokens": accepted, "acceptance_rate": accepted / drafted}


def _ideal_line(s: dict[str, Any], ideal: dict[str, Any]) -> str:
    """The ideal hit rate and the efficiency, or why there is no ideal."""
    if s.get("ideal_hit_rate") is None:
        return f"ideal hit rate: - ({ideal.get('note') or 'unknown'})"
    return (f"ideal hit rate: {_pct(s['ideal_hit_rate'])} (unbounded prefix cache over the prompts sent, "
            f"{ideal.get('page_size', '?')}-token pages), efficiency {_pct(s['efficiency'])}")


def _ideal_cached(records: list[RequestRecord]) -> int | None:
    ideal = [r.ideal_cached_tokens for r in records]
    return None if None in ideal else sum(x for x in ideal if x is not None)


def _ms(value: float | None) -> str:
    return f"{'-':>10}" if value is None else f"{value * 1000:>10.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
