"""Tensor parallelism on CPU (issue 14), each comparison side by side in one run, in alternating
order, medians of several rounds after a warm-up round:

1. ``tierserve serve --tp-size 2`` vs ``--tp-size 1``: prefill and decode throughput (``tp_serving``);
2. L3 pages read at another TP size vs at the writer's (cross / same per page-byte, target >= 0.7),
   written by real TP=2 and TP=1 nodes into a real ``mooncake_master`` (``tp_l3``);
3. KV handoff P2->D1 and P1->D2 (and P1->D1, P2->D2) into real decode nodes vs one raw transfer
   engine write of the same bytes (target >= 0.8), then the real Prefill RPC for context
   (``tp_handoff``).

The model is a random Llama (hidden 512, 4 layers, 8 heads, 4 KV heads of 64, float32: 8 KiB of
KV per token) with the word tokenizer of ``tests/helpers/tiny_models.py``. Logs go to ``--logs``.

    .venv/bin/python benchmarks/tp [--prompt-tokens 1536] [--decode-tokens 64] [--decode-batch 4] \\
        [--repeats 5] [--l3-repeats 15] [--l3-write-repeats 5] [--l3-plain] [--handoff-repeats 9] \\
        [--rpc-repeats 5] [--only serving l3 handoff]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import tp_handoff
import tp_l3
import tp_serving
from tp_common import ModelShape, make_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1536)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--decode-batch", type=int, default=4, help="concurrent decode streams")
    parser.add_argument("--repeats", type=int, default=5, help="serving rounds")
    parser.add_argument("--l3-repeats", type=int, default=15)
    parser.add_argument("--l3-write-repeats", type=int, default=5, help="L3 rounds that also time writes")
    parser.add_argument("--l3-plain", action="store_true",
                        help="L3 writers not told the cluster's TP sizes (no half-page objects)")
    parser.add_argument("--handoff-repeats", type=int, default=9)
    parser.add_argument("--rpc-repeats", type=int, default=5, help="Prefill RPC rounds (0: skip)")
    parser.add_argument("--only", nargs="+", choices=["serving", "l3", "handoff"], default=["serving", "l3", "handoff"])
    parser.add_argument("--logs", type=Path, default=None, help="node logs (default: a temporary folder)")
    args = parser.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="tp-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    shape = ModelShape()
    model = make_model(logs / "tp-llama", shape)
    print(f"model {model} ({shape}); logs in {logs}", flush=True)
    out: list[str] = []
    started = time.monotonic()
    if "serving" in args.only:
        s_args = tp_serving.ServingArgs(args.prompt_tokens, args.decode_tokens, args.decode_batch, args.repeats)
        rounds = tp_serving.measure(model, logs, s_args)
        out += ["", "### 1. Throughput, TP=2 vs TP=1", "", *tp_serving.report(rounds, s_args)]
    if "l3" in args.only:
        l3_args = tp_l3.L3Args(args.prompt_tokens, args.l3_repeats, args.l3_write_repeats, args.l3_plain)
        rounds, facts = tp_l3.measure(model, shape, logs, l3_args)
        out += ["", "### 2. L3 read across TP sizes", "", *tp_l3.report(rounds, facts)]
    if "handoff" in args.only:
        wire, rpc = tp_handoff.measure(model, shape, logs, args.prompt_tokens, args.handoff_repeats, args.rpc_repeats)
        out += ["", "### 3. KV handoff across TP sizes vs the raw transfer engine", "",
                *tp_handoff.report(wire, rpc, shape, args.prompt_tokens)]
    print("\n".join(out))
    print(f"\n(took {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
