"""``tierserve up`` plans without a cluster: ``launch.up`` faked to record the plan ``cmd_up``
makes (nothing starts), and each child's command line as its own parser reads it."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

from tierserve import launch
from tierserve.cli import up as cli_up
from tierserve.cli.main import build_parser
from tierserve.launch import ClusterPlan
from tierserve.launch.plan import stages


def capture_plans(monkeypatch, model_dir: Path | None = Path("/m")) -> list[ClusterPlan]:
    """The plans ``up`` hands ``launch.up`` from now on (which starts nothing and returns 0); with
    ``model_dir``, every ``--model`` resolves to it without a fetch (``None``: the real lookup)."""
    plans: list[ClusterPlan] = []
    monkeypatch.setattr(launch, "up", lambda plan, announce: plans.append(plan) or 0)
    if model_dir is not None:
        monkeypatch.setattr(cli_up, "model_dir", lambda _: model_dir)
    return plans


def run_up(*argv: str) -> int:
    """``tierserve up ARGV``'s exit status (with ``capture_plans`` in place: only the planning)."""
    return cli_up.cmd_up(build_parser().parse_args(["up", *argv]))


def plan_up(monkeypatch, model: Path, *flags: str) -> tuple[int, list[ClusterPlan]]:
    """``up --model MODEL FLAGS`` planned against the real model: its status and plans."""
    plans = capture_plans(monkeypatch, model_dir=None)
    return run_up("--model", str(model), *flags), plans


def children(plan: ClusterPlan) -> dict[str, tuple[str, ...]]:
    """Every child's command line, by name (``prefill-0``, ``decode-0``, ``router``, ...)."""
    return {spec.name: spec.argv for stage in stages(plan) for spec in stage}


def child_args(argv: tuple[str, ...]) -> Namespace:
    """A child's command line as its own parser reads it (past ``python -m tierserve.cli``)."""
    return build_parser().parse_args(list(argv[3:]))
