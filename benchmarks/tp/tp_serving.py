"""Item 1: prefill and decode throughput of ``tierserve serve --tp-size 2`` against ``--tp-size 1``,
both nodes up at once and measured in alternating order through the OpenAI API.

- prefill: one completion of a ``prompt_tokens``-token prompt with ``max_tokens=1``; tokens/s =
  prompt tokens / the request's time (HTTP and tokenizing included: a few ms of seconds);
- decode: ``decode_batch`` concurrent streams of a 64-token prompt, ``decode_tokens`` new tokens
  each (EOS ignored); tokens/s = tokens after each stream's first / (last chunk of any stream -
  first chunk of any stream): the prefill is left out.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tp_common import ServeProcess, median, median_ratio, prompt, rotated

DECODE_PROMPT = 64


@dataclass(frozen=True)
class ServingArgs:
    prompt_tokens: int
    decode_tokens: int
    decode_batch: int
    repeats: int


def serve_flags(prompt_tokens: int) -> list[str]:
    """One chunk per prompt, no prefix cache: every request computes its whole prompt."""
    return ["--max-total-tokens", "8192", "--chunked-prefill-size", str(max(prompt_tokens, 512)),
            "--disable-radix-cache"]


def prefill_seconds(server: ServeProcess, model: str, ids: list[int]) -> float:
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    httpx.post(f"{server.url}/v1/completions", json=body, timeout=600).raise_for_status()
    return time.perf_counter() - start


def _stream(server: ServeProcess, model: str, ids: list[int], new: int, out: list[tuple[float, float, int]]) -> None:
    """One streamed completion: (first chunk time, last chunk time, completion tokens)."""
    body = {"model": model, "prompt": ids, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = 0.0
    tokens = 0
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                first, last = first or now, now
    out.append((first, last, tokens))


def decode_rate(server: ServeProcess, model: str, args: ServingArgs, seed: int) -> float:
    """Decode tokens/s of ``decode_batch`` concurrent streams, their prefills left out."""
    results: list[tuple[float, float, int]] = []
    threads = [threading.Thread(target=_stream, args=(server, model, prompt(DECODE_PROMPT, seed * 100 + i),
                                                      args.decode_tokens, results))
               for i in range(args.decode_batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(results) != args.decode_batch or any(n != args.decode_tokens for _, _, n in results):
        raise RuntimeError(f"decode streams ended short: {results}")
    span = max(last for _, last, _ in results) - min(first for first, _, _ in results)
    return sum(n - 1 for _, _, n in results) / span


def measure(model: Path, logs: Path, args: ServingArgs) -> list[dict[str, float]]:
    """Both nodes up; one warm-up round, then ``repeats`` rounds in rotating order."""
    servers = {tp: ServeProcess(model, tp, logs / f"serve-tp{tp}.log", *serve_flags(args.prompt_tokens))
               for tp in (1, 2)}
    try:
        for s in servers.values():
            s.wait_healthy()
        rounds = []
        for turn in range(args.repeats + 1):
            sample: dict[str, float] = {}
            for name in rotated(["prefill_tp1", "prefill_tp2", "decode_tp1", "decode_tp2"], turn):
                kind, tp = name.split("_tp")
                server, seed = servers[int(tp)], turn * 10 + int(tp)
                if kind == "prefill":
                    sample[name] = args.prompt_tokens / prefill_seconds(server, model.name,
                                                                        prompt(args.prompt_tokens, seed))
                else:
                    sample[name] = decode_rate(server, model.name, args, seed)
            print(f"  serving {'warm-up' if not turn else f'round {turn}'}: "
                  + ", ".join(f"{k} {v:.0f} tok/s" for k, v in sample.items()), flush=True)
            if turn:
                rounds.append(sample)
        return rounds
    finally:
        for s in servers.values():
            s.stop()


def report(rounds: list[dict[str, float]], args: ServingArgs) -> list[str]:
    rows = [f"| prefill, {args.prompt_tokens}-token prompt (tokens/s) | {median(rounds, 'prefill_tp1'):.0f} "
            f"| {median(rounds, 'prefill_tp2'):.0f} | {median_ratio(rounds, 'prefill_tp2', 'prefill_tp1'):.2f} |",
            f"| decode, {args.decode_batch} streams x {args.decode_tokens} tokens (tokens/s) "
            f"| {median(rounds, 'decode_tp1'):.0f} | {median(rounds, 'decode_tp2'):.0f} "
            f"| {median_ratio(rounds, 'decode_tp2', 'decode_tp1'):.2f} |"]
    return ["| `tierserve serve` | TP=1 | TP=2 | TP=2 / TP=1 |", "|---|---:|---:|---:|", *rows]
