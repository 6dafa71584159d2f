"""Structured outputs' cost (issue 30, docs/structured.md): decode tokens/s with a JSON schema against
the same engine without one, in the same run, and the first-use compile time of a 50-property schema.

One engine of the built-in model (CPU, float32, ``--threads`` torch threads). Each round decodes
``--batch`` short prompts for ``--new-tokens`` tokens twice, alternating which goes first: free
(``ignore_eos``) and under a schema that cannot end before ``--new-tokens`` (an object holding an
array of at least that many integers), both greedy. Decode tokens/s counts the tokens after every
request's first (the prefill is not timed). The table shows the medians of ``--repeats`` rounds and
the median of the per-round ratios. On a noisy machine the ratio swings by tens of percent, so the
structured runs also time what structured outputs add to a step directly: filling the grammars'
bitmask rows (``allowed_tokens``) and applying it to the logits (``apply_allowed``), as a share of
their decode time.

Compile: a fresh ``GrammarCompiler`` per repeat (its tokenizer is built first, timed on its own),
then the first ``matcher`` of a 50-property schema (strings, integers, enums, a nested object) and
its first mask; and the API's torch-free ``check`` of the same schema, uncached.

    .venv/bin/python benchmarks/structured.py [--batch 8] [--new-tokens 48] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from tierserve.core.constraint import Constraint, ConstraintKind
from tierserve.core.sampling import SamplingParams
from tierserve.engine import model_runner
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.model import sampling
from tierserve.model.fetch import fetch_builtin_model
from tierserve.structured import grammars
from tierserve.structured.grammars import GrammarCompiler
from tierserve.structured.state import GrammarState


def long_schema(tokens: int) -> Constraint:
    """A schema whose outputs are longer than ``tokens`` tokens: at least that many integers."""
    schema = {"type": "object", "required": ["values"], "additionalProperties": False,
              "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": tokens}}}
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


def fifty_properties() -> Constraint:
    kinds = [{"type": "string", "maxLength": 20}, {"type": "integer", "minimum": 0}, {"enum": ["a", "b", "c"]},
             {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "boolean"}}}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(50)}
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema), strict=True)


class MaskClock:
    """Seconds spent filling and applying grammar masks, while installed."""

    def __init__(self) -> None:
        self.seconds, self.share = 0.0, 0.0  # share: of the last timed run's decode time
        self.on = False
        # the runner masks before sampling (its own ``apply_allowed``); ``sample`` only when given a mask
        for module, name in ((model_runner, "allowed_tokens"), (model_runner, "apply_allowed"),
                             (sampling, "apply_allowed")):
            setattr(module, name, self._timed(getattr(module, name)))

    def _timed(self, fn: Callable) -> Callable:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += (time.perf_counter() - start) if self.on else 0.0
        return timed


def decode_rate(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                clock: MaskClock | None = None) -> float:
    """Decode tokens/s after every request's first token (``clock`` times the masks meanwhile)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", prompt, params)
    first: set[str] = set()
    while len(first) < len(prompts):
        first |= {o.request_id for o in engine.step()}
    start, tokens = time.perf_counter(), 0
    if clock is not None:
        clock.on, clock.seconds = True, 0.0
    while engine.has_work():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    if clock is not None:
        clock.on, clock.share = False, clock.seconds / elapsed
    return tokens / elapsed


def decode_rounds(engine: Engine, args: argparse.Namespace) -> None:
    assert engine.tokenizer is not None
    prompts = [engine.tokenizer.encode(f"List some numbers, set {i}:").ids for i in range(args.batch)]
    free = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    constrained = replace(free, ignore_eos=False, constraint=long_schema(args.new_tokens))
    decode_rate(engine, prompts, constrained)  # warm-up, and the schema compiled before timing
    clock, rows = MaskClock(), []
    for r in range(args.repeats):
        order = [("free", free, None), ("schema", constrained, clock)]
        rates = {name: decode_rate(engine, prompts, p, c) for name, p, c in (order if r % 2 == 0 else order[::-1])}
        rows.append(rates | {"mask": clock.share})
        print(f"round {r}: free {rates['free']:.1f} tok/s, schema {rates['schema']:.1f} tok/s, "
              f"ratio {rates['schema'] / rates['free']:.3f}, masks {clock.share * 100:.2f}% of the schema run",
              flush=True)
    med = {k: statistics.median(row[k] for row in rows) for k in ("free", "schema")}
    ratio = statistics.median(row["schema"] / row["free"] for row in rows)
    print(f"\ndecode tokens/s, batch {args.batch}, {args.new_tokens} tokens, medians of {args.repeats}: "
          f"free {med['free']:.1f}, schema {med['schema']:.1f}; schema/free {ratio:.3f} "
          f"({(1 - ratio) * 100:+.1f}% slower); filling and applying the masks: "
          f"{statistics.median(row['mask'] for row in rows) * 100:.2f}% of the schema runs' decode time")


def compile_times(engine: Engine, args: argparse.Namespace) -> None:
    text = (engine.config.model_dir / "tokenizer.json").read_text()
    vocab, eos = engine.model_config.vocab_size, sorted(engine.eos_ids)
    c = fifty_properties()
    tok_s, first_s, check_s = [], [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        compiler = GrammarCompiler(text, eos, vocab)
        tok_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        state = GrammarState(compiler.matcher(c), vocab)
        state.fill(np.zeros(state.words, dtype=np.int32))
        first_s.append(time.perf_counter() - start)
        grammars._CHECKED.clear()
        start = time.perf_counter()
        grammars.check(c)
        check_s.append(time.perf_counter() - start)
    print(f"50-property schema, medians of {args.repeats}: first compile + first mask "
          f"{statistics.median(first_s) * 1e3:.2f} ms; API check {statistics.median(check_s) * 1e3:.2f} ms; "
          f"(once per engine) tokenizer {statistics.median(tok_s) * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(fetch_builtin_model(progress=False), dtype="float32", max_total_tokens=16384))
    decode_rounds(engine, args)
    compile_times(engine, args)


if __name__ == "__main__":
    main()
