"""Decode speed with vs without speculative decoding, side by side in one run.

Two engines over the same target (the built-in model by default), one speculating: each repeat runs the
same prompts through both, alternating which goes first, at batch 1 and batch 8, greedy, EOS ignored.
Reported per batch size (medians over repeats): decode tokens/s (after every request has its first token)
of each, their ratio, the acceptance rate (accepted / proposed draft tokens), tokens appended per
verification step, and where a speculative step's time goes.

STANDALONE (the default; a draft model): the draft's cost per chain pass (one draft token for each
request), the target's verification pass per step, against a plain decode step; prompts ``TEXTS``.

EAGLE (``--algorithm EAGLE``): a randomly initialised EAGLE-1 head for the target (``tierserve model fetch
--draft --eagle``; ``--eagle-layout eagle3``: an EAGLE-3 one, reading three of the target's layers; or
``--draft DIR``, a trained one): it drafts almost nothing the target accepts, so the
speedup column is its floor; what it measures is the cost of a speculative step (the head's chain and the
target's verification over 1 + steps tokens) relative to a plain decode step, ``step ratio``, and the
per-token acceptance a head would need for speculation to break even at that cost, ``break-even``: the
a with 1 + a + ... + a^steps = step ratio (a chain stops at its first rejection).

NGRAM (``--algorithm NGRAM``, prompt lookup): three workloads. ``copy``: the answer repeats the input,
the prompts ``EDITS`` (a short Python file in a code fence, the same file again with a small edit, and a
third fence opened: the built-in model's greedy answer is a further copy of the file); ``text``: the
``TEXTS`` prompts (natural text and code, whose continuations repeat some runs of tokens); ``norepeat``:
the ``TEXTS`` prompts with every lookup's drafts dropped, so the matcher does all its work each step (index
updates and lookups) and every request decodes plainly, as where nothing repeats: the matcher's cost
alone. Per workload: drafts proposed per step, and the matcher's own time per step
(``NgramDrafter.propose``, timed) against a plain decode step.

    .venv/bin/python benchmarks/speculative.py [--draft DIR] [--steps 1] [--repeats 5] [--new-tokens 48] [--threads N]
    .venv/bin/python benchmarks/speculative.py --algorithm EAGLE --steps 3 [--eagle-layout eagle3] [--draft HEAD] [...]
    .venv/bin/python benchmarks/speculative.py --algorithm NGRAM --steps 5 [--workloads copy,text,norepeat] [...]
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
from tierserve.engine.config import EngineConfig, SpeculativeAlgorithm
from tierserve.engine.engine import Engine
from tierserve.model.draft import fetch_builtin_draft
from tierserve.model.eagle import EagleLayout, random_eagle_for
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

# The files of the copy workload: each is shown, then shown again with a small edit (``_edited``).
FILES = (
    '''def merge_sorted(left, right):
    """Merges two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    out.extend(left[i:])
    out.extend(right[j:])
    return out
''',
    '''class Counter:
    """Counts how often each word occurs in a text."""

    def __init__(self):
        self.counts = {}

    def add(self, text):
        for word in text.lower().split():
            self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n):
        ranked = sorted(self.counts.items(), key=lambda item: item[1], reverse=True)
        return ranked[:n]
''',
    '''def read_config(path):
    """Reads a file of key = value lines into a dictionary."""
    config = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config
''',
    '''def binary_search(items, target):
    """Returns the index of target in the sorted list items, or -1."""
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1
''',
)


def _edited(code: str, edit: int) -> str:
    """``code`` with a small edit: a comment line on top (0) or its docstring removed (1)."""
    lines = code.splitlines(keepends=True)
    return f"# {lines[0].split('(')[0].split()[-1]}: unchanged since 2019\n{code}" if edit == 0 else \
        "".join(line for line in lines if '"""' not in line)


EDITS = tuple(f"```python\n{code}```\n\n```python\n{_edited(code, edit)}```\n\n```python\n"
              for code in FILES for edit in (0, 1))


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


def measure(base: Engine, spec: Engine, prompts: list[list[int]], args: argparse.Namespace, swap: bool,
            dry: bool = False) -> dict:
    """One side-by-side run; ``dry``: the drafter runs but its drafts are dropped (``norepeat``)."""
    clock = Clock()
    drafter = spec.spec.drafter
    timed = clock.wrap("draft", drafter.propose)
    drafter.propose = (lambda *a: timed(*a) and {}) if dry else timed
    counters = spec.spec.counters
    drafted, accepted, verifies = counters.draft_tokens, counters.accepted_tokens, counters.verify_steps
    runs = {}
    for name, engine in ((("spec", spec), ("base", base)) if swap else (("base", base), ("spec", spec))):
        runs[name] = decode_run(engine, prompts, args.new_tokens)
    del drafter.propose
    d_drafted, d_verifies = counters.draft_tokens - drafted, counters.verify_steps - verifies
    (b_s, b_tokens, b_steps), (s_s, s_tokens, s_steps) = runs["base"], runs["spec"]
    return {"base_tok_s": b_tokens / b_s, "spec_tok_s": s_tokens / s_s, "speedup": b_s / s_s,
            "acceptance": (counters.accepted_tokens - accepted) / max(d_drafted, 1),
            "tokens_per_step": (counters.accepted_tokens - accepted + d_verifies) / max(d_verifies, 1),
            "base_step_ms": 1000 * b_s / b_steps,
            "draft_ms_per_pass": 1000 * clock.seconds["draft"] * len(prompts) / max(d_drafted, 1),
            "verify_ms_per_step": 1000 * (s_s - clock.seconds["draft"]) / s_steps,
            "spec_step_ms": 1000 * s_s / s_steps, "step_ratio": (s_s / s_steps) / (b_s / b_steps),
            "drafts_per_step": d_drafted / s_steps, "matcher_ms_per_step": 1000 * clock.seconds["draft"] / s_steps}


STANDALONE_COLUMNS = (("base tok/s", "base_tok_s", ".1f"), ("spec tok/s", "spec_tok_s", ".1f"),
                      ("speedup", "speedup", ".2f"), ("acceptance", "acceptance", ".2f"),
                      ("tokens/step", "tokens_per_step", ".2f"), ("base step ms", "base_step_ms", ".1f"),
                      ("draft ms/pass", "draft_ms_per_pass", ".1f"), ("verify ms/step", "verify_ms_per_step", ".1f"))
EAGLE_COLUMNS = (("base tok/s", "base_tok_s", ".1f"), ("eagle tok/s", "spec_tok_s", ".1f"),
                 ("speedup", "speedup", ".2f"), ("acceptance", "acceptance", ".2f"),
                 ("base step ms", "base_step_ms", ".1f"), ("spec step ms", "spec_step_ms", ".1f"),
                 ("head ms/pass", "draft_ms_per_pass", ".1f"), ("step ratio", "step_ratio", ".2f"),
                 ("break-even", "break_even", ".2f"))
NGRAM_COLUMNS = (("base tok/s", "base_tok_s", ".1f"), ("ngram tok/s", "spec_tok_s", ".1f"),
                 ("speedup", "speedup", ".2f"), ("drafts/step", "drafts_per_step", ".2f"),
                 ("acceptance", "acceptance", ".2f"), ("tokens/step", "tokens_per_step", ".2f"),
                 ("base step ms", "base_step_ms", ".1f"), ("matcher ms/step", "matcher_ms_per_step", ".3f"),
                 ("matcher share", "matcher_share", ".2%"))


def table(workload: str, prompts: list[list[int]], base: Engine, spec: Engine, args: argparse.Namespace,
          columns: tuple) -> None:
    """One row per batch size: medians over ``args.repeats`` side-by-side runs."""
    for batch in (int(b) for b in args.batches.split(",")):
        rows = [measure(base, spec, [prompts[(r + i) % len(prompts)] for i in range(batch)], args, r % 2 == 1,
                        dry=workload == "norepeat") for r in range(args.repeats)]
        for row in rows:
            row["matcher_share"] = row["matcher_ms_per_step"] / row["base_step_ms"]
            row["break_even"] = break_even(row["step_ratio"], args.steps)
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        cells = " | ".join(f"{med[key]:{fmt}}" for _, key, fmt in columns)
        print(f"| {workload} | {batch} | {cells} |", flush=True)


def break_even(ratio: float, steps: int) -> float:
    """The per-token acceptance a at which a speculative step costing ``ratio`` plain steps yields as
    many tokens per second: 1 + a + ... + a^steps = ratio (bisection; 1.0 when even a = 1 does not)."""
    low, high = 0.0, 1.0
    if steps + 1 <= ratio:
        return 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(mid**i for i in range(steps + 1)) < ratio else (low, mid)
    return low


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--algorithm", type=SpeculativeAlgorithm, default=SpeculativeAlgorithm.STANDALONE)
    parser.add_argument("--draft", type=Path, default=None, help="STANDALONE: default tierserve model fetch --draft; "
                        "EAGLE: a head folder, default a random head (model fetch --draft --eagle)")
    parser.add_argument("--eagle-layout", type=EagleLayout, default=EagleLayout.EAGLE1,
                        help="EAGLE without --draft: the random head's layout (eagle1 or eagle3)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--workloads", default="copy,text,norepeat", help="NGRAM: copy, text and/or norepeat")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or fetch_builtin_model(progress=False)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    common = dict(dtype="float32", max_total_tokens=8192, disable_radix_cache=True, speculative_num_steps=args.steps)
    base = Engine(EngineConfig(model, **{k: v for k, v in common.items() if k != "speculative_num_steps"}))
    if args.algorithm is SpeculativeAlgorithm.NGRAM:
        spec = Engine(EngineConfig(model, **common, speculative_algorithm=SpeculativeAlgorithm.NGRAM))
        low, high, window = spec.config.ngram_sizes
        print(f"target {model.name}, NGRAM (match {low}-{high} tokens, window {window}), {args.steps} draft tokens "
              f"per step at most, {args.new_tokens} new tokens, {args.repeats} repeats (medians), "
              f"{torch.get_num_threads()} threads")
        columns, texts = NGRAM_COLUMNS, {"copy": EDITS, "text": TEXTS, "norepeat": TEXTS}
        workloads = args.workloads.split(",")
    elif args.algorithm is SpeculativeAlgorithm.EAGLE:
        draft = args.draft or random_eagle_for(model, args.eagle_layout)
        spec = Engine(EngineConfig(model, **common, speculative_draft_model_path=draft,
                                   speculative_algorithm=SpeculativeAlgorithm.EAGLE))
        print(f"target {model.name}, EAGLE head {draft.name}, {args.steps} draft tokens per step, "
              f"{args.new_tokens} new tokens, {args.repeats} repeats (medians), {torch.get_num_threads()} threads")
        columns, texts, workloads = EAGLE_COLUMNS, {"text": TEXTS}, ["text"]
    else:
        draft = args.draft or fetch_builtin_draft(progress=False)
        spec = Engine(EngineConfig(model, **common, speculative_draft_model_path=draft))
        print(f"target {model.name}, draft {draft.name}, {args.steps} draft tokens per step, "
              f"{args.new_tokens} new tokens, {args.repeats} repeats (medians), {torch.get_num_threads()} threads")
        columns, texts, workloads = STANDALONE_COLUMNS, {"text": TEXTS}, ["text"]
    names = " | ".join(name for name, _, _ in columns)
    print(f"| workload | batch | {names} |\n|---|---:|" + "---:|" * len(columns))
    for workload in workloads:
        table(workload, [tok.encode(t).ids for t in texts[workload]], base, spec, args, columns)


if __name__ == "__main__":
    main()
