"""``tierserve model fetch``: convert the built-in model into the local cache."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger("tierserve")


def add_model_commands(model: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    fetch = sub.add_parser("fetch", help="convert the built-in model into the local cache", parents=[common])
    fetch.add_argument("--cache-dir", type=Path, help="models directory (default: ~/.cache/tierserve/models)")
    fetch.set_defaults(func=cmd_model_fetch)


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from tierserve.model.fetch import fetch_builtin_model

    log.info("fetching the built-in model")
    print(fetch_builtin_model(cache_dir=args.cache_dir, progress=True))
    return 0
