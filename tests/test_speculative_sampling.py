"""Speculative sampling follows the target's distribution, per algorithm (a draft model's, an EAGLE-1
head's or an EAGLE-3 head's drafts drawn from its q, the EAGLE-3 head's over a draft vocabulary of 3 of
the 5 tokens mapped by ``d2t``, so q is 0 on the others; NGRAM's point-mass drafts): on a 5-token
vocabulary, the first three tokens of thousands of seeded requests are checked against the exact
distribution computed with transformers (chi-square), and a verifier that accepts every draft fails
the same check."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import make_tiny_model

import tierserve.engine.spec.decoder as speculative
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig, SpeculativeAlgorithm
from tierserve.engine.engine import Engine
from tierserve.engine.spec.sampling import probs
from tierserve.model.eagle import write_random_eagle, write_random_eagle3

VOCAB, PROMPT, SAMPLES = 5, [2, 3, 4], 1500
PARAMS = dict(max_tokens=4, temperature=1.0, ignore_eos=True)  # t1 from the prefill, t2 and t3 from 2 drafts


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vocab5")
    return (make_tiny_model("llama", root / "target", seed=0, vocab_size=VOCAB),
            make_tiny_model("llama", root / "draft", seed=1, layers=1, vocab_size=VOCAB))


@pytest.fixture(scope="module")
def drafts(pair: tuple[Path, Path], tmp_path_factory) -> dict[str, Path | None]:
    """Per draft source, its draft: the draft model; none for NGRAM; random EAGLE-1 and EAGLE-3 heads for the
    target (on 5 tokens their drafts are often right, often not), the EAGLE-3 head reading the
    residuals entering the target's layers 0, 1 and 2, with a draft vocabulary of 3 tokens."""
    root = tmp_path_factory.mktemp("eagle5")
    return {"standalone": pair[1], "ngram": None, "eagle": write_random_eagle(pair[0], root / "head"),
            "eagle3": write_random_eagle3(pair[0], root / "head3", capture=(0, 1, 2), draft_vocab=3)}


def _exact(target: Path) -> dict[tuple[int, ...], float]:
    """p(t1, t2, t3 | PROMPT) under the target, from transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def next_probs(seq: list[int]) -> list[float]:
        with torch.no_grad():
            return model(torch.tensor([seq])).logits[0, -1].softmax(-1).tolist()

    out = {}
    for t1, t2 in itertools.product(range(VOCAB), repeat=2):
        p1, p2 = next_probs(PROMPT)[t1], next_probs([*PROMPT, t1])[t2]
        for t3, p3 in enumerate(next_probs([*PROMPT, t1, t2])):
            out[(t1, t2, t3)] = p1 * p2 * p3
    return out


# Per algorithm: its settings, and the fewest draft tokens the requests must have been proposed.
# NGRAM matches single tokens here: after t1 in {2, 3, 4} it proposes what followed t1 in the prompt.
SPEC = {SpeculativeAlgorithm.STANDALONE: ({}, SAMPLES),  # the chain proposes 2 tokens per request
        SpeculativeAlgorithm.EAGLE: ({"speculative_algorithm": SpeculativeAlgorithm.EAGLE}, SAMPLES),
        SpeculativeAlgorithm.NGRAM: ({"speculative_algorithm": SpeculativeAlgorithm.NGRAM,
                                      "speculative_ngram_min_match_window_size": 1}, SAMPLES // 2)}


# each draft source's algorithm (an EAGLE-3 head is EAGLE's; its checkpoint says which layout it has)
SOURCES = {"standalone": SpeculativeAlgorithm.STANDALONE, "eagle": SpeculativeAlgorithm.EAGLE,
           "eagle3": SpeculativeAlgorithm.EAGLE, "ngram": SpeculativeAlgorithm.NGRAM}


def _sampled(target: Path, draft: Path | None, algorithm: SpeculativeAlgorithm) -> dict[tuple[int, ...], int]:
    settings, least = SPEC[algorithm]
    model = {"speculative_draft_model_path": draft} if draft is not None else {}
    engine = Engine(EngineConfig(target, dtype="float32", page_size=4, max_total_tokens=16384,
                                 speculative_num_steps=2, **model, **settings))
    for i in range(SAMPLES):
        engine.add_request(f"s{i}", PROMPT, SamplingParams(seed=i, **PARAMS))
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.spec.counters.draft_tokens > least
    counts: dict[tuple[int, ...], int] = {}
    for seq in tokens.values():
        counts[tuple(seq[:3])] = counts.get(tuple(seq[:3]), 0) + 1
    return counts


def _p_value(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness of fit; cells expecting fewer than 5 samples are pooled into one."""
    n = sum(counts.values())
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in exact.items():
        if p * n < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(cell, 0), pooled_exp + p * n
            continue
        stat, cells = stat + (counts.get(cell, 0) - p * n) ** 2 / (p * n), cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    return float(torch.special.gammaincc(torch.tensor((cells - 1) / 2), torch.tensor(stat / 2)))


def _accept_always(drafts, dists, logits, row) -> list[int]:
    """A biased verifier: keeps every draft and adds the target's bonus token."""
    generator = row.generator(len(drafts), logits.device)
    return [*drafts, int(torch.multinomial(probs(logits[-1:], row)[0], 1, generator=generator))]


@pytest.mark.slow
@pytest.mark.parametrize("source", list(SOURCES))
def test_sampled_tokens_follow_the_target_distribution(pair: tuple[Path, Path], drafts: dict[str, Path | None],
                                                       monkeypatch, source: str) -> None:
    target, draft, algorithm = pair[0], drafts[source], SOURCES[source]
    exact = _exact(target)
    assert _p_value(_sampled(target, draft, algorithm), exact) > 1e-3
    monkeypatch.setattr(speculative, "verify", _accept_always)
    assert _p_value(_sampled(target, draft, algorithm), exact) < 1e-6
