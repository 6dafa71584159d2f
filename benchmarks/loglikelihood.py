"""Throughput of a loglikelihood (multiple-choice scoring) workload with prompt caching vs without.

An lm-eval-style task: ``--questions`` questions share a ``--context``-token few-shot prefix; each
question (``--question`` tokens) has 4 choices of ``--choice`` tokens, and each choice is one
request (prefix + question + choice, one generated token) asking for the prompt's logprobs, the
4 choices of a question sent together, questions one after another (as lm-eval's
local-completions sends them). Three ways of asking:

- ``echo``: OpenAI's ``echo`` + ``logprobs``: every prompt token scored, so every position's
  logits are needed and the cache can serve nothing (docs/cli.md);
- ``start``: prompt logprobs from the choice's first token on (SGLang's ``logprob_start_len``):
  the prefix and question may come from the cache;
- ``none``: no logprobs at all (a plain prefill of the same prompts), the baseline cost.

Each way runs with prompt caching and without on one engine (built-in model, float32; the same
weights for both, as two engines' copies of the weights ran at different speeds): with caching a run
has a cache salt of its own (no run sees another's KV), without it every request has one (nothing is
ever reused). Every run repeats ``--repeats`` times. The six runs
of a repetition are interleaved question by question, in an order rotated every question, so a
noisy machine's load changes hit them alike; a run's rate is its requests over the seconds its own
questions took. Reported are median requests/s over repetitions and the on/off ratio.

    .venv/bin/python benchmarks/loglikelihood.py [--questions 8] [--context 256] [--repeats 3] [--threads N]
        [--ways echo start none]

Prompt tokens computed per request are the prompt tokens not reported cached (a request's cached
tokens are its match at admission, in-flight shared pages included: docs/cache.md).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass

import torch

from tierserve.core.sampling import SamplingParams
from tierserve.core.scope import CacheScope
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.model.fetch import fetch_builtin_model

WAYS = ("echo", "start", "none")
_ids = itertools.count()


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    choice_start: int  # the first token of the choice


def workload(args: argparse.Namespace, vocab: int) -> list[list[Request]]:
    """One list of 4 requests per question, the same for every run."""
    gen = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(2, vocab, (n,), generator=gen).tolist()  # noqa: E731
    prefix = tokens(args.context)
    out = []
    for _ in range(args.questions):
        head = prefix + tokens(args.question)
        out.append([Request(head + tokens(args.choice), len(head)) for _ in range(4)])
    return out


def params(way: str, request: Request) -> SamplingParams:
    if way == "none":
        return SamplingParams(max_tokens=1, temperature=0)
    start = 1 if way == "echo" else request.choice_start
    return SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1, prompt_logprobs_start=start)


def question(engine: Engine, way: str, choices: list[Request], salt: str | None) -> tuple[float, int]:
    """Seconds to score one question's choices together, and their prompt tokens from the cache
    (``salt`` None: a salt per request, so no caching)."""
    started, cached = time.perf_counter(), 0
    for r in choices:
        rid = f"q{next(_ids)}"
        engine.add_request(rid, r.prompt, params(way, r), scope=CacheScope(cache_salt=salt or rid))
    while engine.has_work():
        cached += sum(o.cached_tokens for o in engine.step() if o.finished)
    return time.perf_counter() - started, cached


def repetition(engine: Engine, questions: list[list[Request]], ways: list[str]) -> dict[tuple[str, bool], tuple]:
    """(requests/s, cached tokens) of every (way, cache on) run, interleaved question by question."""
    runs = [(way, on) for way in ways for on in (True, False)]
    salts = {(way, on): f"run-{next(_ids)}" if on else None for way, on in runs}
    seconds, cached = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0)
    for q, choices in enumerate(questions):
        for way, on in runs[q % len(runs):] + runs[: q % len(runs)]:
            s, c = question(engine, way, choices, salts[way, on])
            seconds[way, on] += s
            cached[way, on] += c
    total = sum(len(q) for q in questions)
    return {r: (total / seconds[r], cached[r]) for r in runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--question", type=int, default=16)
    ap.add_argument("--choice", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = fetch_builtin_model(progress=False)
    engine = Engine(EngineConfig(model, dtype="float32", page_size=16, max_total_tokens=32768))
    questions = workload(args, engine.model_config.vocab_size)
    results = [repetition(engine, questions, args.ways) for _ in range(args.repeats)]
    rates = {r: [res[r][0] for res in results] for r in results[0]}
    cached = {r: results[-1][r][1] for r in results[0]}
    print(f"model={model.name} float32 threads={torch.get_num_threads()} questions={args.questions} "
          f"context={args.context} question={args.question} choice={args.choice} repeats={args.repeats}")
    requests = [r for q in questions for r in q]
    prompt = sum(len(r.prompt) for r in requests)
    print("| logprobs | cache on req/s | cache off req/s | on/off | cached tokens per run (on) | prompt tokens "
          "computed per request (on) |")
    print("|---|---:|---:|---:|---:|---:|")
    for way in args.ways:
        on, off = statistics.median(rates[way, True]), statistics.median(rates[way, False])
        computed = (prompt - cached[way, True]) / len(requests)
        print(f"| {way} | {on:.2f} | {off:.2f} | {on / off:.2f} | {cached[way, True]} of {prompt} | {computed:.1f} |")


if __name__ == "__main__":
    main()
