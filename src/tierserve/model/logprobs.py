"""Token log-probabilities from logits rows: float32 log-softmax of the logits it is given, the raw
ones (no temperature, no top-k/top-p, no min_tokens mask: vLLM's default ``raw_logprobs``, docs/cli.md)
or, for a structured output, those its grammar masked (docs/structured.md)."""

from __future__ import annotations

import math

import torch

from tierserve.core.outputs import TokenLogprob


def token_logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[TokenLogprob]:
    """For each row i of ``logits`` [n, vocab]: the log-probability of ``targets[i]`` and the
    ``ks[i]`` most likely tokens with theirs, less any at -inf (a token a grammar forbade, so a row
    that allows fewer than ``ks[i]`` lists fewer). One log-softmax, one gather and one top-k for all rows."""
    if not targets:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = torch.tensor(targets, dtype=torch.int64, device=logits.device)
    chosen = lp.gather(-1, picked[:, None])[:, 0].tolist()
    k = max(ks)
    values, ids = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprob(t, c, tuple((j, x) for j, x in zip(i[:n], v[:n], strict=True) if x > -math.inf))
            for t, c, i, v, n in zip(targets, chosen, ids, values, ks, strict=True)]
