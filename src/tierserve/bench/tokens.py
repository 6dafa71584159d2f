"""Deterministic synthetic prompt content: token ids inside a model's vocabulary, or text.

Token ids are drawn from ``[min_id, vocab_size)``: the low ids of most vocabularies are special
tokens (SmolLM2: 0..16 are ``<|endoftext|>``, ``<|im_start|>``...), and a special token inside a
prompt changes what the model does (or is refused), which a benchmark must not depend on."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Common short English words: most are one token in BPE vocabularies with a leading space, so a text
# prompt of n words is roughly n tokens. The report counts the server's real prompt tokens anyway.
_WORD_LIST = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land different home "
    "us move try kind hand picture again change off play spell air away animal house point page letter "
    "mother answer found study still learn should world high every near add food between own below country "
    "plant last school father keep tree never start city earth eye light thought head under story saw left "
    "few while along might close something seem next hard open example begin life always those both paper "
    "together got group often run important until children side feet car mile night walk white sea began grow"
)
WORDS = tuple(_WORD_LIST.split())


@dataclass(frozen=True)
class TokenSpace:
    """The ids a synthetic prompt may use: ``min_id <= id < vocab_size``."""

    vocab_size: int = 49152  # SmolLM2, the built-in model
    min_id: int = 32  # above every special token of SmolLM2 (and of the tiny test models)

    def __post_init__(self) -> None:
        if not 0 <= self.min_id < self.vocab_size - 1:
            raise ValueError(f"need 0 <= min_id < vocab_size - 1, got {self.min_id} and {self.vocab_size}")

    @property
    def span(self) -> int:
        return self.vocab_size - self.min_id

    def random_ids(self, rng: random.Random, n: int) -> list[int]:
        return [self.min_id + rng.randrange(self.span) for _ in range(n)]

    def tagged_ids(self, tag: int, rng: random.Random, n: int) -> list[int]:
        """``n`` ids whose first two encode ``tag`` (base ``span``), so blocks with different tags
        (below ``span**2``) never share their first token pair, whatever the random rest draws."""
        if tag < 0 or tag >= self.span ** 2:
            raise ValueError(f"tag {tag} does not fit two tokens of a {self.span}-id space")
        head = [self.min_id + tag % self.span, self.min_id + tag // self.span]
        return (head + self.random_ids(rng, max(0, n - 2)))[:n]


def random_text(rng: random.Random, n_words: int) -> str:
    """``n_words`` words, space-separated (roughly as many tokens)."""
    return " ".join(rng.choice(WORDS) for _ in range(n_words))
