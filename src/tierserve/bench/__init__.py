"""Load generators, trace replay and reports (``tierserve bench``). A client only: no torch.

For scripts::

    from tierserve.bench import BenchOptions, MultiTurnConfig, multiturn, run_bench

    report = run_bench("http://127.0.0.1:8000", multiturn(MultiTurnConfig(clients=16, rounds=5)),
                       BenchOptions(mode="closed", clients=8, barrier=True))
    print(report.table()); report.summary()["hit_rate"]; report.to_json("run.json")

Names load on first use, so importing the package (the console script does) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BenchOptions": "runner", "run_bench": "runner", "run_bench_async": "runner", "arrivals": "runner",
    "Report": "report", "RequestRecord": "records", "RequestSpec": "records", "TokenSpace": "tokens",
    "Workload": "workloads", "MultiTurnConfig": "workloads", "SharedPrefixConfig": "workloads",
    "multiturn": "workloads", "shared_prefix": "workloads",
    "TraceConfig": "traces", "mooncake_trace": "traces", "azure_trace": "traces",
    "IdealCache": "ideal", "ideal_cached_tokens": "ideal",
    "compare": "compare", "save_plots": "plots", "plot_ttft_cdf": "plots", "plot_hit_rate": "plots",
    "plot_server_view": "plots", "server_figures": "server_metrics",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
