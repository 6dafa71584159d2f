"""Where a long-prompt multi-turn workload's prompt tokens are served from, CP=1 vs CP=2 (issue 15):
the seed's shape, where sharding the pages across CP ranks raised the device share of hits at the
same per-rank memory and cut the host-served tokens.

Each CP size gets its own ``mooncake_master`` (so neither node reads what the other wrote) and a
real ``tierserve serve --cp-size N`` node with HiCache and L3, every rank with the same budgets:
``--budget`` tokens of L1 per rank, L2 ``--host-ratio`` times that. ``--conversations`` chats, each
starting from its own ``--prefix`` tokens of random context, take ``--requests`` turns in all; the
chat of each turn is drawn with Zipf weights (chat c with weight 1/(c+1), a fixed seed), so a few
hot chats come back often and the rest rarely, as in a chat service. Each turn sends that chat's
whole history plus ``USER_TOKENS`` new tokens and appends the answer. The working set outgrows a
CP=1 node's L1 and is partly held by a CP=2 node's (twice the tokens at the same per-rank memory).
Both nodes get the same turns side by side, alternating which goes first; every request's
``usage.cached_tokens_by_tier`` is summed per CP size over the turns after each chat's first
(which can only be computed). ``--repeats`` rounds on fresh nodes, chats and draws; the table shows
medians.

    .venv/bin/python benchmarks/cp_multiturn.py [--conversations 8] [--prefix 4096] [--requests 40] \\
        [--budget 12288] [--host-ratio 3] [--repeats 3] [--logs DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' node helpers, reused

from helpers.long_prompts import l3_flags, long_model, start_node, stream  # noqa: E402
from helpers.processes import MasterProcess  # noqa: E402
from helpers.rank_servers import TPServer  # noqa: E402

from tierserve.core.tiers import TIERS  # noqa: E402

CP_SIZES = (1, 2)
USER_TOKENS = 256
NEW_TOKENS = 8
SOURCES = (*TIERS, "computed")


def tokens(n: int, seed: int) -> list[int]:
    """``n`` random token ids (each seed a text no cache holds yet)."""
    return torch.randint(2, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Chats:
    """The chats' histories (token ids), the same for both CP sizes, and what each turn was served from."""

    def __init__(self, conversations: int, prefix: int, seed: int) -> None:
        self.seed = seed
        self.history = {cp: [tokens(prefix, seed + c) for c in range(conversations)] for cp in CP_SIZES}
        self.served = {cp: dict.fromkeys(SOURCES, 0) for cp in CP_SIZES}
        self.ttft: dict[int, list[float]] = {cp: [] for cp in CP_SIZES}

    def turn(self, node: TPServer, model: Path, cp: int, chat: int, turn: int) -> None:
        """Sends chat ``chat``'s history plus a new user message; counts where it was served from
        (not on turn 0) and appends the message and the answer to the history."""
        prompt = self.history[cp][chat] + tokens(USER_TOKENS, self.seed + 1000 * (turn + 1) + chat)
        reply = stream(node, model, prompt, NEW_TOKENS)
        if turn:
            for tier in TIERS:
                self.served[cp][tier] += reply.tiers.get(tier, 0)
            self.served[cp]["computed"] += len(prompt) - sum(reply.tiers.get(t, 0) for t in TIERS)
            self.ttft[cp].append(reply.ttft_s)
        self.history[cp][chat] = prompt + reply.tokens


def draws(conversations: int, requests: int, seed: int) -> list[int]:
    """The chat of each turn, Zipf-weighted: chat c comes back with weight 1/(c+1)."""
    weights = [1 / (c + 1) for c in range(conversations)]
    return random.Random(seed).choices(range(conversations), weights=weights, k=requests)


def one_round(model: Path, logs: Path, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """Fresh masters, nodes and chats; every turn sent to both CP sizes (order alternating)."""
    masters = {cp: MasterProcess(logs / f"master-cp{cp}-{seed}.log").start() for cp in CP_SIZES}
    nodes: dict[int, TPServer] = {}
    try:
        for cp in CP_SIZES:
            flags = l3_flags(masters[cp], args.budget, args.host_ratio)
            nodes[cp] = start_node(model, cp, logs / f"node-cp{cp}-{seed}.log", *flags)
        chats = Chats(args.conversations, args.prefix, seed)
        turns = [0] * args.conversations
        for i, chat in enumerate(draws(args.conversations, args.requests, seed)):
            for cp in CP_SIZES if i % 2 == 0 else CP_SIZES[::-1]:
                chats.turn(nodes[cp], model, cp, chat, turns[chat])
            turns[chat] += 1
        return _shares(chats)
    finally:
        for node in nodes.values():
            node.stop()
        for master in masters.values():
            master.kill()


def _shares(chats: Chats) -> dict[str, float]:
    """Per CP size: each source's share of the prompt tokens and the median TTFT."""
    out = {}
    for cp in CP_SIZES:
        total = sum(chats.served[cp].values())
        out |= {f"cp{cp}_{s}": chats.served[cp][s] / total for s in SOURCES}
        out |= {f"cp{cp}_{s}_tokens": float(chats.served[cp][s]) for s in SOURCES}
        out[f"cp{cp}_ttft"] = statistics.median(chats.ttft[cp])
    return out


def report(rounds: list[dict[str, float]]) -> list[str]:
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    rows = ["| CP | device | host | storage | computed | median TTFT (s) |", "|---:|---:|---:|---:|---:|---:|"]
    for cp in CP_SIZES:
        shares = " | ".join(f"{med[f'cp{cp}_{s}']:.1%}" for s in SOURCES)
        rows.append(f"| {cp} | {shares} | {med[f'cp{cp}_ttft']:.3f} |")
    device = med["cp2_device"] - med["cp1_device"]
    host = [r["cp2_host_tokens"] / r["cp1_host_tokens"] for r in rounds if r["cp1_host_tokens"]]
    ratio = f"{statistics.median(host):.2f}" if host else "n/a (CP=1 served none from host)"
    return [*rows, "", f"device share CP=2 - CP=1: {device * 100:+.1f} points; host-served tokens CP=2 / CP=1: {ratio}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=4096, help="tokens of context each chat starts from")
    parser.add_argument("--requests", type=int, default=40, help="turns in all, over the chats")
    parser.add_argument("--budget", type=int, default=12288, help="L1 tokens per rank")
    parser.add_argument("--host-ratio", type=float, default=3.0, help="L2 per rank as a multiple of L1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--logs", type=Path, default=None, help="node logs (default: a temporary folder)")
    args = parser.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="cp-multiturn-"))
    logs.mkdir(parents=True, exist_ok=True)
    model = long_model(logs / "llama-long")
    print(f"model {model}; logs in {logs}", flush=True)
    started, rounds = time.monotonic(), []
    for r in range(args.repeats):
        rounds.append(one_round(model, logs, args, seed=100_000 * (r + 1)))
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v:.3g}" for k, v in rounds[-1].items()
                                             if not k.endswith("_tokens")), flush=True)
    print("\n".join(["", *report(rounds)]))
    print(f"\n(took {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
