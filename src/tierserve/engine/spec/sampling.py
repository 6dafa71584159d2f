"""Speculative sampling: drawing draft tokens and verifying them against the target without changing
what the target would sample (Leviathan et al. 2023, Chen et al. 2023)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierserve.model.sampling import SamplingBatch, _filtered_probs, position_generator


@dataclass(frozen=True)
class RowSampling:
    """One request's sampling settings (``temperature`` 0: greedy), its seed (None: draws from the
    process's default generator) and ``position``, the index of the first token this step decides."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    position: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, offset: int, device: torch.device, draft: bool = False) -> torch.Generator | None:
        """The generator of the draws deciding the token at ``position + offset``: a function of the
        seed and the position alone (model/sampling.py). The draft's draws take their own stream,
        because an acceptance test must be independent of the draft token it judges."""
        if self.seed is None:
            return None
        position = self.position + offset
        return position_generator(self.seed, -1 - position if draft else position, device)


def probs(logits: torch.Tensor, row: RowSampling) -> torch.Tensor:
    """The distribution ``sample`` draws from for float32 ``logits`` [n, vocab] under ``row``'s
    temperature, top-k and top-p (every row of ``logits`` with the same settings)."""
    n = logits.shape[0]
    batch = SamplingBatch([row.temperature] * n, [row.top_p] * n, [row.top_k] * n, [None] * n, [0] * n)
    return _filtered_probs(logits / row.temperature, batch)


def draw(logits: torch.Tensor, rows: list[RowSampling], step: int) -> tuple[list[int], list[torch.Tensor | None]]:
    """A draft token per row of ``logits`` [n, vocab], the chain's ``step``-th, and the distribution
    q it was drawn from (None for greedy rows: q is then the argmax's point mass)."""
    tokens = logits.argmax(dim=-1).tolist()
    dists: list[torch.Tensor | None] = [None] * len(rows)
    for i, row in enumerate(rows):
        if not row.greedy:
            dists[i] = probs(logits[i: i + 1], row)[0]
            tokens[i] = _choice(dists[i], row.generator(step, logits.device, draft=True))
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
        generator = row.generator(i, p.device)
        u = torch.rand((), device=p.device, generator=generator)
        if float(u) * float(q[token]) < float(p[i, token]):
            continue
        residual = (p[i] - q).clamp_(min=0)
        return [*drafts[:i], _choice(residual if float(residual.sum()) > 0 else p[i], generator)]
    return [*drafts, _choice(p[len(drafts)], row.generator(len(drafts), p.device))]


def _choice(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn with probability proportional to ``weights`` [vocab]."""
    return int(torch.multinomial(weights, 1, generator=generator))
