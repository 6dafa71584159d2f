"""``tierserve serve``: one engine behind the OpenAI-compatible HTTP API (no router, no
disaggregation); with ``--tp-size T --pp-size S`` the engine spans T * S rank processes, the API
on rank 0."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierserve.cli.flags import (
    add_admission_args,
    add_api_key_args,
    add_chat_args,
    add_engine_args,
    add_listen_args,
    add_model_args,
    add_tracing_args,
    node_engine_config,
    tenant_keys,
    tracing_config,
)

if TYPE_CHECKING:
    from tierserve.engine.config import EngineConfig
    from tierserve.engine.engine import Engine
    from tierserve.engine.procs.spawn import RankProcesses


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_listen_args(p, 8000)
    add_model_args(p)
    add_api_key_args(p, "the /admin routes (L3 attach/detach/status/clear)")
    add_chat_args(p)
    add_tracing_args(p)
    add_admission_args(p)
    add_engine_args(p)


def cmd_serve(args: argparse.Namespace, on_ready: Callable[[], None] | None = None) -> int:
    """Loads the engine and serves it until SIGINT/SIGTERM, then stops the engine thread (and the
    other ranks); 2 for a usage error, such as a TP or PP size the model cannot be split over."""
    config = node_engine_config(args)
    if config is None or not _fits(config) or not _draft_fits(config) or not _keys_ok(args) or not _port_free(args):
        return 2
    if config.num_ranks == 1:
        from tierserve.engine.engine import Engine

        _serve(args, Engine(config), on_ready)
        return 0
    return _serve_ranks(args, config, on_ready)


def _port_free(args: argparse.Namespace) -> bool:
    """Says at once, not after the model loaded, that ``--port`` is taken."""
    from tierserve.launch.probes import listen_error

    if (error := listen_error(args.host, args.port)) is not None:
        print(f"tierserve: {error}", file=sys.stderr)
    return error is None


def _keys_ok(args: argparse.Namespace) -> bool:
    """Reads ``--api-keys`` before the engine loads: a bad file is a usage error, said at once."""
    try:
        args.tenant_keys = tenant_keys(args)
    except ValueError as exc:
        print(f"tierserve: {exc}", file=sys.stderr)
        return False
    return True


def _fits(config: EngineConfig) -> bool:
    """Refuses, before any process starts, a TP size the model's heads or MLP cannot be split over,
    or stages its layers cannot fill (more stages than layers, a partition that does not add up to them)."""
    from tierserve.model.parallel import misfit

    problem = misfit(config.model_dir, config.tp_size, config.pp_size, config.pp_layer_partition)
    if problem is not None:
        print(f"tierserve: {config.layout_flags} does not fit {config.model_dir.name}: {problem}", file=sys.stderr)
    return problem is None


def _draft_fits(config: EngineConfig) -> bool:
    """Refuses, before loading anything, a draft model that cannot draft for the target."""
    if config.speculative_draft_model_path is None:
        return True
    from tierserve.engine.spec.draft_pools import draft_problem

    if (problem := draft_problem(config)) is not None:
        print(f"tierserve: {problem}", file=sys.stderr)
        return False
    return True


def _serve_ranks(args: argparse.Namespace, config: EngineConfig, on_ready: Callable[[], None] | None) -> int:
    """Rank 0: starts the other ranks, builds its engine with them, serves; a dead rank ends the process."""
    from tierserve.engine.engine import Engine
    from tierserve.engine.procs.spawn import RankProcesses

    ranks = RankProcesses(config, args.log_level)
    try:
        engine = Engine(config, ranks=ranks.join())
    except BaseException:
        ranks.stop(grace_s=0)  # they wait for rank 0, which will never send them anything
        raise
    try:
        _serve(args, engine, on_ready, ranks)
    finally:
        ranks.stop()  # the stop message went out: they leave on their own
    return 0


def _serve(args: argparse.Namespace, engine: Engine, on_ready: Callable[[], None] | None,
           ranks: RankProcesses | None = None) -> None:
    from tierserve.api.engine_backend import create_engine_app
    from tierserve.api.http import run_http
    from tierserve.api.tokenizer import try_load
    from tierserve.engine.loop import EngineLoop
    from tierserve.engine.procs.step_bus import LeaderBus
    from tierserve.tracing import start_tracing

    bus = LeaderBus(engine.ranks, ranks.fail) if ranks is not None else None
    watch = ranks.watch() if ranks is not None else None
    loop = EngineLoop(engine, bus, watch).start()
    try:
        name = args.served_model_name or engine.model_config.name
        tokenizer = try_load(engine.config.model_dir, args.chat_template, args.tool_call_parser)
        tracer = start_tracing(tracing_config(args), "tierserve", f"{args.host}:{args.port}")
        app = create_engine_app(loop, tokenizer, name, args.tenant_keys, args.admin_api_key, args.admission, tracer)
        _exit_cleanly_on_sigterm()
        run_http(app, args.host, args.port, on_ready)
    finally:
        loop.stop()  # tells the other ranks to stop
        engine.cache.close()  # stops the L2/L3 workers and closes the L3 client


def _exit_cleanly_on_sigterm() -> None:
    """uvicorn, once it stopped on SIGTERM, raises the signal again with the handler it found: the
    default one would end the process there, before the engine, the other ranks and the L2/L3 lanes
    stop and the L3 client unmounts (docs/ranks.md, stop). ``SystemExit`` instead runs those ``finally``
    blocks and exits 0."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)
