"""Speculative sampling: drawing draft tokens and verifying them against the target without changing
what the target would sample (Leviathan et al. 2023, Chen et al. 2023)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierserve.model.sampling import SamplingBatch, _filtered_probs


@dataclass(frozen=True)
class RowSampling:
    """One request's sampling settings (``temperature`` 0: greedy) and its generator (None: the
    process's default one), which draws all of its randomness: drafts, acceptances, corrections."""

    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits: torch.Tensor, row: RowSampling) -> torch.Tensor:
    """The distribution ``sample`` draws from for float32 ``logits`` [n, vocab] under ``row``'s
    temperature, top-k and top-p (every row of ``logits`` with the same settings)."""
    n = logits.shape[0]
    batch = SamplingBatch([row.temperature] * n, [row.top_p] * n, [row.top_k] * n, [row.generator] * n)
    return _filtered_probs(logits / row.temperature, batch)


def draw(logits: torch.Tensor, rows: list[RowSampling]) -> tuple[list[int], list[torch.Tensor | None]]:
    """A draft token per row of ``logits`` [n, vocab] and the distribution q it was drawn from
    (None for greedy rows: q is then the argmax's point mass)."""
    tokens = logits.argmax(dim=-1).tolist()
    dists: list[torch.Tensor | None] = [None] * len(rows)
    for i, row in enumerate(rows):
        if not row.greedy:
            dists[i] = probs(logits[i: i + 1], row)[0]
            tokens[i] = _choice(dists[i], row.generator)
    return tokens, dists


def verify(drafts: list[int], dists: list[torch.Tensor | None], logits: torch.Tensor, row: RowSampling) -> list[int]:
    """The tokens a verification step appends: the accepted prefix of ``drafts`` plus one token
    from the target (a correction at the first rejection, else a bonus token). ``logits`` [k + 1,
    vocab] are the target's at the position before each draft and after the last one. Greedy:
    accept while the draft equals the target's argmax. Sampled: accept draft x with probability
    min(1, p(x) / q(x)); at a rejection draw from norm(max(0, p - q)); so every token follows p."""
    if row.greedy:
        best = logits.argmax(dim=-1).tolist()
        accepted = next((i for i, (d, b) in enumerate(zip(drafts, best, strict=False)) if d != b), len(drafts))
        return [*drafts[:accepted], best[accepted]]
    p = probs(logits, row)
    for i, (token, q) in enumerate(zip(drafts, dists, strict=True)):
        u = torch.rand((), device=p.device, generator=row.generator)
        if float(u) * float(q[token]) < float(p[i, token]):
            continue
        residual = (p[i] - q).clamp_(min=0)
        return [*drafts[:i], _choice(residual if float(residual.sum()) > 0 else p[i], row.generator)]
    return [*drafts, _choice(p[len(drafts)], row.generator)]


def _choice(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn with probability proportional to ``weights`` [vocab]."""
    return int(torch.multinomial(weights, 1, generator=generator))
