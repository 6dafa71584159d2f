"""Throughput of our engine vs Hugging Face ``generate``, side by side in one run.

Same model, same prompts (64-256 tokens), same dtype (float32), greedy, EOS ignored.

- ``b1``: one request, ``--new-tokens`` output tokens: prefill tok/s and decode tok/s.
- ``b16``: one batch of 16 requests that all want ``--new-tokens`` tokens, a static batch's best
  case: prefill tok/s and decode tok/s.
- ``serve16``: 48 requests with output lengths that vary as real ones do (uniform in
  [8, 2 * new_tokens - 8]), at most 16 at a time. Ours admits a waiting request as soon as one
  finishes (continuous batching); Hugging Face runs them as static batches of 16 in arrival
  order, each padded and run until its longest request ends. Reported: useful output tokens per
  second of wall time (prefill included), for both.

Each scenario is repeated with fresh prompts (``b1``, short and noisy, three times as often);
the table shows medians. Our prefix cache is off: Hugging Face has none, and the prompts share
nothing anyway.

    .venv/bin/python benchmarks/engine_vs_hf.py [--model DIR] [--repeats 3] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.model.fetch import fetch_builtin_model

SCENARIOS = ("b1", "b16", "serve16")


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 257, (n,), generator=gen).tolist()
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for length in lengths]


def mixed_lengths(n: int, new_tokens: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(8, 2 * new_tokens - 7, (n,), generator=gen).tolist()


def ours(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> tuple[float, float, float]:
    """(prefill tok/s until every request has its first token, decode tok/s after that, wall s)."""
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(f"b{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    start, first_tokens, prefill_done = time.perf_counter(), 0, None
    while engine.has_work():
        for out in engine.step():
            first_tokens += out.completion_tokens == 1
        if prefill_done is None and first_tokens == len(prompts):
            prefill_done = time.perf_counter()
    end = time.perf_counter()
    prefill = sum(map(len, prompts)) / (prefill_done - start)
    return prefill, sum(n - 1 for n in lengths) / (end - prefill_done), end - start


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad: int) -> float:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, eos_token_id=None, pad_token_id=pad)
    return time.perf_counter() - start


def hf(model, prompts: list[list[int]], lengths: list[int], pad: int) -> tuple[float, float]:
    """Prefill = a 1-token generate; decode = the rest of a generate as long as the longest request."""
    t1 = hf_generate(model, prompts, 1, pad)
    tn = hf_generate(model, prompts, max(lengths), pad)
    return sum(map(len, prompts)) / t1, sum(n - 1 for n in lengths) / (tn - t1)


def run_scenario(name: str, engine: Engine, model, repeat: int, new_tokens: int) -> dict:
    vocab = engine.model_config.vocab_size
    if name in ("b1", "b16"):
        batch = 1 if name == "b1" else 16
        prompts, lengths = make_prompts(batch, vocab, repeat), [new_tokens] * batch
        po, do, _ = ours(engine, prompts, lengths)
        ph, dh = hf(model, prompts, lengths, pad=0)
        return {"prefill": (po, ph), "decode": (do, dh)}
    prompts, lengths = make_prompts(48, vocab, repeat), mixed_lengths(48, new_tokens, repeat)
    useful = sum(lengths)
    _, _, wall = ours(engine, prompts, lengths)
    hf_wall = sum(hf_generate(model, prompts[i : i + 16], max(lengths[i : i + 16]), 0) for i in range(0, 48, 16))
    return {"output": (useful / wall, useful / hf_wall)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    args = ap.parse_args()
    import transformers

    model_dir = args.model or fetch_builtin_model()
    cfg = EngineConfig(model_dir, dtype="float32", page_size=16, max_total_tokens=32768, max_running_requests=16,
                       disable_radix_cache=True)
    engine = Engine(cfg)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():  # warm-up: first touch of the KV pool, kernel selection
        ours(engine, make_prompts(2, engine.model_config.vocab_size, 99), [4, 4])
        hf(model, make_prompts(2, engine.model_config.vocab_size, 99), [4, 4], pad=0)
    print(f"model={model_dir.name} dtype=float32 threads={torch.get_num_threads()} "
          f"new_tokens={args.new_tokens} repeats={args.repeats} (medians)\n")
    print("| scenario | metric | ours | Hugging Face | ratio |")
    print("|---|---|---:|---:|---:|")
    for name in args.scenarios:
        with torch.inference_mode():
            repeats = args.repeats * (3 if name == "b1" else 1)
            runs = [run_scenario(name, engine, model, r, args.new_tokens) for r in range(repeats)]
        for metric in runs[0]:
            o = statistics.median(r[metric][0] for r in runs)
            h = statistics.median(r[metric][1] for r in runs)
            print(f"| {name} | {metric} tok/s | {o:.1f} | {h:.1f} | {o / h:.2f} |", flush=True)


if __name__ == "__main__":
    main()
