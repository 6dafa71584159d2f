"""Where a campaign's wrong output leaves the reference, and how far: a numerical near-tie (two
compute paths rounding differently) or damaged KV (issue 31's wrong output after a PP stage's kill).

Replays the request on the campaign's tiny model with ``transformers`` (float32, greedy, the KV of
the prompt computed once and kept), then reports the step where the wrong text leaves the greedy
path, the reference's top-2 logit margin there, the wrong token's rank, the smallest margin of the
steps before it (those survived whatever differed), and whether the rest of the wrong text is the
greedy continuation after the wrong token. A margin at the seam far above the smallest one before it
says the KV the request saw was damaged, not rounded; a greedy continuation says the damage was
small (it moved one close decision) rather than a different state altogether.

    .venv/bin/python benchmarks/faults/diverge.py --model /tmp/relr/work/tiny-llama --seed 25 \\
        --ending 'l reuse layer reuse model tool' --length 3708 --max-tokens 16 \\
        --at 89 --got 'armoredárregn Refrigregn'

``--seed``: the experiment's ``requests(300, seed)`` (``faults/experiments.py``); ``--ending``,
``--length``, ``--max-tokens``, ``--at`` and ``--got`` as the report's wrong-output note gives them
(``Reference.describe`` in ``faults/workload.py``; its ``got`` is at most 40 characters, so the wrong
text is compared as far as it goes). ``--page-scan`` also tries each page of each
layer zeroed, from the first decode step on, and lists those that reproduce the wrong text exactly.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent.parent))

from faults.workload import requests

from tierserve.api.tokenizer import TextTokenizer

PAGE_SIZE = 16  # tierserve's default, the campaign's


@dataclass(frozen=True)
class Step:
    """One greedy decision: the token taken and its margin over the runner-up."""

    token: int
    margin: float


def find_prompt(seed: int, ending: str, length: int, max_tokens: int) -> tuple[int, str]:
    """The index and prompt of the experiment's request the note describes."""
    for i, r in enumerate(requests(300, seed)):
        if len(r.prompt) == length and r.prompt.endswith(ending) and r.max_tokens == max_tokens:
            return i, r.prompt
    raise SystemExit(f"no request of seed {seed} ends {ending!r} with {length} chars and max_tokens {max_tokens}")


def decode(model: transformers.PreTrainedModel, cache: object, first: int, n: int) -> list[Step]:
    """``n`` greedy steps after ``first`` over ``cache`` (changed in place)."""
    steps, last = [], first
    with torch.no_grad():
        for _ in range(n):
            out = model(torch.tensor([[last]]), past_key_values=cache, use_cache=True)
            top = torch.topk(out.logits[0, -1], 2)
            last = int(top.indices[0])
            steps.append(Step(last, float(top.values[0] - top.values[1])))
    return steps


def prefill(model: transformers.PreTrainedModel, ids: list[int]) -> tuple[object, torch.Tensor]:
    """The prompt's KV cache and the logits of its last position."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    return out.past_key_values, out.logits[0, -1]


def seam(tok: TextTokenizer, tokens: list[int], got: str) -> int:
    """The first step whose text the wrong output does not continue."""
    return next(k for k in range(len(tokens)) if not got.startswith(tok.decode(tokens[: k + 1])))


def wrong_token(tok: TextTokenizer, logits: torch.Tensor, before: list[int], got: str) -> tuple[int, int]:
    """The token (and its rank) the wrong output took at the seam, among the 2,000 likeliest."""
    prefix = tok.decode(before)
    for rank, t in enumerate(torch.argsort(logits, descending=True)[:2000].tolist()):
        text = tok.decode([*before, t])
        if len(text) > len(prefix) and got.startswith(text):
            return t, rank
    raise SystemExit("the wrong output's token is not among the 2,000 likeliest")


def page_scan(model: transformers.PreTrainedModel, tok: TextTokenizer, ids: list[int], first: int, n: int,
              got: str) -> list[tuple[int, int]]:
    """(layer, page) pairs whose KV zeroed for the whole decode gives exactly ``got``."""
    cache, _ = prefill(model, ids)
    hits = []
    for layer in range(len(cache.layers)):
        for page in range((len(ids) + PAGE_SIZE - 1) // PAGE_SIZE):
            damaged = copy.deepcopy(cache)
            for t in (damaged.layers[layer].keys, damaged.layers[layer].values):
                t[:, :, page * PAGE_SIZE : (page + 1) * PAGE_SIZE] = 0
            steps = decode(model, damaged, first, n)
            if tok.decode([first, *(s.token for s in steps)])[: len(got)] == got:
                hits.append((layer, page))
    return hits


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--ending", required=True)
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--at", type=int, required=True)
    p.add_argument("--got", required=True)
    p.add_argument("--page-scan", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    index, prompt = find_prompt(args.seed, args.ending, args.length, args.max_tokens)
    tok = TextTokenizer.from_dir(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = tok.encode(prompt)
    cache, logits = prefill(model, ids)
    first = int(logits.argmax())
    steps = [Step(first, float(torch.topk(logits, 2).values.diff().abs()))]
    steps += decode(model, cache, first, args.max_tokens - 1)
    tokens = [s.token for s in steps]
    want = tok.decode(tokens)
    got = want[: args.at] + args.got
    k = seam(tok, tokens, got)
    _, seam_logits = prefill(model, ids + tokens[:k])
    token, rank = wrong_token(tok, seam_logits, tokens[:k], got)
    rest = decode(model, prefill(model, ids + tokens[:k])[0], token, args.max_tokens - k - 1)
    greedy_rest = tok.decode([*tokens[:k], token, *(s.token for s in rest)])[: len(got)] == got
    print(f"request {index} of seed {args.seed}: {len(ids)} prompt tokens; the reference gives {want!r}")
    survived = min((s.margin for s in steps[:k]), default=float("nan"))  # a wrong first token: none before
    print(f"leaves it at step {k} of {args.max_tokens}: took {tok.decode([token])!r} (rank {rank}), "
          f"margin there {steps[k].margin:.4g}; smallest margin before: {survived:.4g}")
    print(f"the rest is the greedy continuation after it: {greedy_rest}")
    if args.page_scan:
        print("zeroed (layer, page) that reproduce it:", page_scan(model, tok, ids, first, args.max_tokens - 1, got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
