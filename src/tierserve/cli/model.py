"""``tierserve model fetch``: convert the built-in model into the local cache."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger("tierserve")


def add_model_commands(model: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    fetch = sub.add_parser("fetch", help="convert the built-in model into the local cache", parents=[common])
    fetch.add_argument("--cache-dir", type=Path, help="models directory (default: ~/.cache/tierserve/models)")
    fetch.add_argument("--draft", action="store_true",
                       help="derive the built-in model's draft (for --speculative-draft-model-path) and print its path")
    fetch.add_argument("--draft-layers", help="with --draft: the target layers the draft keeps, e.g. 0,1,2,29 "
                       "(default: the measured best)")
    fetch.set_defaults(func=cmd_model_fetch)


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from tierserve.model.fetch import fetch_builtin_model

    if args.draft:
        return _fetch_draft(args)
    log.info("fetching the built-in model")
    print(fetch_builtin_model(cache_dir=args.cache_dir, progress=True))
    return 0


def _fetch_draft(args: argparse.Namespace) -> int:
    from tierserve.model.draft import BUILTIN_DRAFT_LAYERS, fetch_builtin_draft

    try:
        layers = tuple(int(x) for x in args.draft_layers.split(",")) if args.draft_layers else BUILTIN_DRAFT_LAYERS
        print(fetch_builtin_draft(args.cache_dir, layers))
    except ValueError as exc:
        print(f"tierserve: --draft-layers: {exc}", file=sys.stderr)
        return 2
    return 0
