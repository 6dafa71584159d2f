"""NGRAM speculation (prompt lookup, docs/speculative.md): a request's drafts are the tokens that
followed the latest earlier occurrence of its last few tokens, in its prompt or its output so far.
No second model and no draft KV: only the target's verification pass runs.

Bounded per request: its ``PromptLookup`` indexes the n-grams ending in its latest ``window``
tokens (at most ``window`` x (longest - shortest + 1) entries), each appended token costs one
insertion and one eviction per n-gram length, and a lookup one probe per length."""

from __future__ import annotations

import torch

from tierserve.engine.request import Request
from tierserve.engine.scheduler import Scheduled
from tierserve.engine.spec.drafts import Drafted
from tierserve.engine.spec.spans import Span
from tierserve.model.attention import LayerHooks


def _window(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """``(prompt + output)[start:end]`` without copying the whole sequence."""
    n = len(prompt)
    if start >= n:
        return output[start - n: end - n]
    return prompt[start:end] + (output[: end - n] if end > n else [])


class PromptLookup:
    """One request's n-gram index over its latest ``window`` tokens: the key of each n-gram
    (``shortest <= n <= longest``) ending at position j maps to j + 1, where its continuation
    starts; a later occurrence overwrites an earlier one. Keys are the n-grams' hashes and a hit is
    compared with the tokens, so a collision only costs a miss."""

    def __init__(self, shortest: int, longest: int, window: int) -> None:
        self.shortest, self.longest, self.window = shortest, longest, window
        self.index: dict[int, int] = {}
        self.indexed = self.start = 0  # n-grams ending in [start, indexed) are in the index (or evicted)

    def propose(self, prompt: list[int], output: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last n
        tokens, the longest n found first; [] when none of them occurred in the window."""
        total = len(prompt) + len(output)
        self._update(prompt, output, total)
        tail = _window(prompt, output, max(0, total - self.longest), total)
        for n in range(min(self.longest, len(tail)), self.shortest - 1, -1):
            gram = tail[len(tail) - n:]
            start = self.index.get(hash(tuple(gram)))
            if start is not None and _window(prompt, output, start - n, start) == gram:
                return _window(prompt, output, start, min(start + k, total))
        return []

    def _update(self, prompt: list[int], output: list[int], total: int) -> None:
        """Indexes the n-grams ending at positions up to total - 2 (the last token's n-grams have no
        continuation yet) and evicts those ending before the window; reads only the tokens of the
        positions it indexes and evicts (never the whole window)."""
        end = total - 1
        first = max(self.indexed, end - self.window)
        if first > self.indexed:  # the first call, or tokens appended past the window: start afresh
            self.index.clear()
            self.start = first
        old_first, old_end = max(self.start, first - self.window), end - self.window
        if old_end > old_first:
            base = max(0, old_first - self.longest + 1)
            stale = _window(prompt, output, base, old_end)
            for j in range(old_first, old_end):
                self._evict(stale, base, j)
        base = max(0, first - self.longest + 1)
        fresh = _window(prompt, output, base, end)
        for j in range(first, end):
            self._insert(fresh, base, j)
        self.indexed = max(self.indexed, end)

    def _insert(self, seq: list[int], base: int, j: int) -> None:
        for n in range(self.shortest, min(self.longest, j + 1) + 1):
            self.index[hash(tuple(seq[j + 1 - n - base: j + 1 - base]))] = j + 1

    def _evict(self, seq: list[int], base: int, j: int) -> None:
        """Drops the n-grams ending at ``j`` unless a later occurrence took their key."""
        for n in range(self.shortest, min(self.longest, j + 1) + 1):
            key = hash(tuple(seq[j + 1 - n - base: j + 1 - base]))
            if self.index.get(key) == j + 1:
                del self.index[key]


class NgramDrafter:
    """Proposes each speculating request's drafts by prompt lookup (``Drafter``); point-mass drafts,
    so a sampled row's q is one-hot: verification accepts x with probability p(x) and draws a
    rejection's correction from p without x, the target's distribution exactly."""

    def __init__(self, sizes: tuple[int, int, int], vocab_size: int, device: torch.device) -> None:
        """``sizes``: (shortest match, longest match, window), ``EngineConfig.ngram_sizes``."""
        self.sizes, self.vocab_size, self.device = sizes, vocab_size, device
        self.lookups: dict[str, tuple[Request, PromptLookup]] = {}

    def propose(self, batch: list[Scheduled], hooks: LayerHooks | None) -> dict[str, Drafted]:
        """Drafts of the speculating requests of ``batch`` that found a match (the others decode
        plainly); the indexes of requests not in ``batch`` are dropped (finished, aborted or
        preempted: a preempted request's is rebuilt when it decodes again)."""
        self._forget_others(batch)
        out: dict[str, Drafted] = {}
        for s in batch:
            r = s.request
            tokens = self.lookup(r).propose(r.prompt_ids, r.output_ids, s.draft_tokens) if s.draft_tokens else []
            if tokens:
                out[r.request_id] = Drafted(tokens, [None if r.params.greedy else self._point(t) for t in tokens])
        return out

    def target_pass(self, spans: list[Span], hidden: list[torch.Tensor], hooks: LayerHooks | None) -> None:
        """Nothing: the draft reads no target hidden states."""

    def sync(self, batch: list[Scheduled], hooks: LayerHooks | None) -> None:
        """Nothing to compute: no draft KV."""

    def verified(self, request: Request, drafted: Drafted, accepted: int) -> None:
        """Nothing to move: the index follows the request's tokens at the next lookup."""

    def lookup(self, request: Request) -> PromptLookup:
        """``request``'s index: a new one for a request it has not seen (or a new request of a known id)."""
        known = self.lookups.get(request.request_id)
        if known is None or known[0] is not request:
            known = self.lookups[request.request_id] = (request, PromptLookup(*self.sizes))
        return known[1]

    def _forget_others(self, batch: list[Scheduled]) -> None:
        ids = {s.request.request_id for s in batch}
        for rid in [rid for rid in self.lookups if rid not in ids]:
            del self.lookups[rid]

    def _point(self, token: int) -> torch.Tensor:
        q = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
        q[token] = 1.0
        return q
