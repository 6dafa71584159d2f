"""Decode speed with vs without speculative decoding, side by side in one run.

Two engines over the same target (the built-in model by default), one with the draft: each repeat
runs the same prompts through both, alternating which goes first, at batch 1 and batch 8, greedy,
EOS ignored. Reported per batch size (medians over repeats): decode tokens/s (after every request
has its first token) of each, their ratio, the acceptance rate (accepted / proposed draft tokens),
tokens appended per verification step, and where a speculative step's time goes: the draft's cost
per chain pass (one draft token for each request), the target's verification pass per step, against a plain decode step.

    .venv/bin/python benchmarks/speculative.py [--draft DIR] [--steps 1] [--repeats 5] [--new-tokens 48] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.model.draft import fetch_builtin_draft
from tierserve.model.fetch import fetch_builtin_model

TEXTS = (
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Photosynthesis is the process by which green plants",
    "The following is a list of the planets of the solar system in order:",
    "import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):\n    def __init__(self):",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes,",
)


class Clock:
    """Seconds spent inside wrapped calls, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return timed


def decode_run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, int]:
    """(decode seconds after every request's first token, decode tokens, decode steps)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", prompt, params)
    first: set[str] = set()
    while len(first) < len(prompts):
        first |= {o.request_id for o in engine.step()}
    start, steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    return time.perf_counter() - start, len(prompts) * (new_tokens - 1), steps


def measure(base: Engine, spec: Engine, prompts: list[list[int]], args: argparse.Namespace, swap: bool) -> dict:
    clock = Clock()
    spec.spec._propose = clock.wrap("draft", spec.spec._propose)
    counters = spec.spec.counters
    drafted, accepted, verifies = counters.draft_tokens, counters.accepted_tokens, counters.verify_steps
    runs = {}
    for name, engine in ((("spec", spec), ("base", base)) if swap else (("base", base), ("spec", spec))):
        runs[name] = decode_run(engine, prompts, args.new_tokens)
    del spec.spec._propose
    d_drafted, d_verifies = counters.draft_tokens - drafted, counters.verify_steps - verifies
    (b_s, b_tokens, b_steps), (s_s, s_tokens, s_steps) = runs["base"], runs["spec"]
    return {"base_tok_s": b_tokens / b_s, "spec_tok_s": s_tokens / s_s, "speedup": b_s / s_s,
            "acceptance": (counters.accepted_tokens - accepted) / max(d_drafted, 1),
            "tokens_per_step": (counters.accepted_tokens - accepted + d_verifies) / max(d_verifies, 1),
            "base_step_ms": 1000 * b_s / b_steps,
            "draft_ms_per_pass": 1000 * clock.seconds["draft"] * len(prompts) / max(d_drafted, 1),
            "verify_ms_per_step": 1000 * (s_s - clock.seconds["draft"]) / s_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--draft", type=Path, default=None, help="default: tierserve model fetch --draft")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or fetch_builtin_model(progress=False)
    draft = args.draft or fetch_builtin_draft(progress=False)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in TEXTS]
    common = dict(dtype="float32", max_total_tokens=8192, disable_radix_cache=True)
    base = Engine(EngineConfig(model, **common))
    spec = Engine(EngineConfig(model, **common, speculative_draft_model_path=draft, speculative_num_steps=args.steps))
    print(f"target {model.name}, draft {draft.name}, {args.steps} draft tokens per step, "
          f"{args.new_tokens} new tokens, {args.repeats} repeats (medians), {torch.get_num_threads()} threads")
    print("| batch | base tok/s | spec tok/s | speedup | acceptance | tokens/step | base step ms | "
          "draft ms/pass | verify ms/step |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        rows = [measure(base, spec, [prompts[(r + i) % len(prompts)] for i in range(batch)], args, r % 2 == 1)
                for r in range(args.repeats)]
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        print(f"| {batch} | {med['base_tok_s']:.1f} | {med['spec_tok_s']:.1f} | {med['speedup']:.2f} | "
              f"{med['acceptance']:.2f} | {med['tokens_per_step']:.2f} | {med['base_step_ms']:.1f} | "
              f"{med['draft_ms_per_pass']:.1f} | {med['verify_ms_per_step']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
