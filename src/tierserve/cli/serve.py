"""``tierserve serve``: one engine behind the OpenAI-compatible HTTP API (no router, no
disaggregation)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from tierserve.cli.flags import add_api_key_args, add_engine_args, add_listen_args, add_model_args, node_engine_config


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_listen_args(p, 8000)
    add_model_args(p)
    add_api_key_args(p, "the /admin routes (L3 attach/detach/status/clear)")
    add_engine_args(p)


def cmd_serve(args: argparse.Namespace, on_ready: Callable[[], None] | None = None) -> int:
    """Loads the engine and serves it until SIGINT/SIGTERM, then stops the engine thread."""
    from tierserve.api.engine_backend import create_engine_app
    from tierserve.api.http import run_http
    from tierserve.api.tokenizer import try_load
    from tierserve.engine.engine import Engine
    from tierserve.engine.loop import EngineLoop

    config = node_engine_config(args)
    if config is None:
        return 2
    engine = Engine(config)
    loop = EngineLoop(engine).start()
    try:
        app = create_engine_app(loop, try_load(config.model_dir), args.served_model_name or engine.model_config.name,
                                args.api_key, args.admin_api_key)
        run_http(app, args.host, args.port, on_ready)
    finally:
        loop.stop()
        engine.cache.close()  # stops the L2/L3 workers and closes the L3 client
    return 0
