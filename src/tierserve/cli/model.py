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
    fetch.add_argument("--eagle", action="store_true",
                       help="with --draft: write a randomly initialised EAGLE-1 head instead (for "
                       "--speculative-algorithm EAGLE; it drafts little the target accepts: a trained head is "
                       "brought as a folder, docs/speculative.md)")
    fetch.add_argument("--eagle-layout", choices=["eagle1", "eagle3"], default="eagle1",
                       help="with --draft --eagle: the head's checkpoint layout (eagle3: it reads the inputs of the "
                       "target's layers 2, L/2 and L-3, and drafts over the target's vocabulary)")
    fetch.add_argument("--target", type=Path, help="with --draft --eagle: the model folder the head is for "
                       "(default: the built-in model); the head is written beside it as <name>-eagle-random "
                       "(<name>-eagle3-random)")
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

    if args.eagle:
        return _fetch_eagle(args)
    if args.target is not None or args.eagle_layout != "eagle1":
        print("tierserve: --target and --eagle-layout need --eagle", file=sys.stderr)
        return 2

    try:
        layers = tuple(int(x) for x in args.draft_layers.split(",")) if args.draft_layers else BUILTIN_DRAFT_LAYERS
        print(fetch_builtin_draft(args.cache_dir, layers))
    except ValueError as exc:
        print(f"tierserve: --draft-layers: {exc}", file=sys.stderr)
        return 2
    return 0


def _fetch_eagle(args: argparse.Namespace) -> int:
    """A random EAGLE head for ``--target`` (or the built-in model), written once; prints its folder."""
    from tierserve.model.eagle import EagleLayout, random_eagle_for
    from tierserve.model.fetch import fetch_builtin_model

    if args.draft_layers:
        print("tierserve: --draft-layers derives a layer subset; it does not go with --eagle", file=sys.stderr)
        return 2
    target = args.target or fetch_builtin_model(args.cache_dir, progress=True)
    if not (target / "config.json").is_file():
        print(f"tierserve: --target {target} is not a model folder (no config.json)", file=sys.stderr)
        return 2
    try:
        print(random_eagle_for(target, EagleLayout(args.eagle_layout)))
    except ValueError as exc:  # a target too shallow for the default layers, say
        print(f"tierserve: {exc}", file=sys.stderr)
        return 2
    return 0
