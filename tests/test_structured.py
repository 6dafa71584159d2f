"""Structured outputs in the engine (docs/structured.md), on a tiny Qwen3 with the built-in model's
tokenizer: sampled outputs always match their schema, regex or choice; the grammar survives a
migration (rebuilt from the tokens so far) and speculative decoding (drafts verified under the mask)
with the same greedy output; logprobs are of the masked distribution; a schema compiles once."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import jsonschema
import pytest
from helpers.tiny_models import BUILTIN_VOCAB, add_builtin_tokenizer, make_noisy_draft, make_tiny_model

from tierserve.core.constraint import Constraint, ConstraintKind
from tierserve.core.outputs import TokenLogprob
from tierserve.core.sampling import InvalidRequestError, SamplingParams
from tierserve.engine.config import EngineConfig, SpeculativeAlgorithm
from tierserve.engine.engine import Engine
from tierserve.engine.request import FinishReason
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto.sampling import from_proto, to_proto
from tierserve.router.migration import resumed

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}
JSON = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
CHOICES = ["yes", "no", "maybe not"]
CHOICE = Constraint(ConstraintKind.CHOICE, json.dumps(CHOICES))


@dataclass(frozen=True)
class _Routed:
    """The router's request as migration sees it (``router.migration.Resumable``)."""

    id: str
    prompt: list[int]
    sampling: pb.SamplingOptions
    resumed: int


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return add_builtin_tokenizer(make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"), vocab_size=BUILTIN_VOCAB))


@pytest.fixture(scope="module")
def engine(model: Path) -> Engine:
    return _engine(model)


def _engine(model: Path, **kw) -> Engine:
    return Engine(EngineConfig(model, dtype="float32", page_size=4, max_total_tokens=8192, **kw))


def _prompts(engine: Engine, n: int) -> list[list[int]]:
    assert engine.tokenizer is not None
    return [engine.tokenizer.encode(f"Tell me about person number {i}.").ids for i in range(n)]


def _text(engine: Engine, ids: list[int]) -> str:
    assert engine.tokenizer is not None
    return engine.tokenizer.decode(ids)


@pytest.mark.slow
def test_sampled_outputs_always_match_the_schema_and_end_by_themselves(engine: Engine) -> None:
    params = SamplingParams(max_tokens=60, temperature=1.0, constraint=JSON)
    outs = engine.generate(_prompts(engine, 24), params)
    for ids in outs:
        jsonschema.validate(json.loads(_text(engine, ids)), SCHEMA)
        assert len(ids) < 60  # ended by the grammar, not by max_tokens


def test_regex_and_choice_hold_greedy_and_sampled(engine: Engine) -> None:
    regex = Constraint(ConstraintKind.REGEX, r"[a-z]{2,4}-[0-9]{2}")
    choice = Constraint(ConstraintKind.CHOICE, json.dumps(["yes", "no", "maybe not"]))
    for temperature in (0.0, 1.0):
        for ids in engine.generate(_prompts(engine, 6), SamplingParams(max_tokens=20, temperature=temperature,
                                                                      constraint=regex)):
            assert re.fullmatch(r"[a-z]{2,4}-[0-9]{2}", _text(engine, ids))
        for ids in engine.generate(_prompts(engine, 6), SamplingParams(max_tokens=20, temperature=temperature,
                                                                      constraint=choice)):
            assert _text(engine, ids) in ("yes", "no", "maybe not")


def test_logprobs_are_of_the_distribution_the_grammar_masked(engine: Engine) -> None:
    """Logprobs of a constrained request are of the masked distribution (docs/structured.md): every
    listed token is one the grammar allowed, and since a choice allows fewer than 20 tokens at each
    step, the 20 best are all of them and carry all the mass (the raw distribution's 20 best of
    49152 tokens carry far less)."""
    lps = _logprobs(engine, "lp", _prompts(engine, 1)[0], SamplingParams(max_tokens=20, temperature=1.0, seed=3,
                                                                          logprobs=20, constraint=CHOICE))
    _assert_masked(engine, lps)


def _logprobs(engine: Engine, rid: str, prompt: list[int], params: SamplingParams) -> list[TokenLogprob]:
    """The sampled tokens' logprobs of one request run to its end (by the grammar: ``stop``)."""
    engine.add_request(rid, prompt, params)
    outs = [o for _ in range(100) if engine.has_work() for o in engine.step()]
    assert outs[-1].finish_reason is FinishReason.STOP
    entries = [lp for o in outs for lp in o.logprobs or []]
    assert len(entries) == sum(len(o.new_token_ids) for o in outs)
    return entries


def _assert_masked(engine: Engine, lps: list[TokenLogprob]) -> None:
    text = ""
    for lp in lps:
        assert all(any(c.startswith(text + _text(engine, [t])) for c in CHOICES) for t, _ in lp.top)
        assert sum(math.exp(v) for _, v in lp.top) == pytest.approx(1.0, abs=1e-4)
        assert dict(lp.top)[lp.token_id] == pytest.approx(lp.logprob, abs=1e-6)
        text += _text(engine, [lp.token_id])
    assert text in CHOICES


def test_a_migrated_request_resumes_its_grammar_after_the_tokens_so_far(engine: Engine) -> None:
    """A migration re-prefills prompt + output so far with ``resumed`` set (``router/migration.py``
    sets it): the greedy continuation equals the uninterrupted output."""
    prompt = _prompts(engine, 1)[0]
    params = SamplingParams(max_tokens=60, temperature=0, constraint=JSON)
    whole = engine.generate([prompt], params)[0]
    k = len(whole) // 2
    request = _Routed("r", prompt, to_proto(params), 0)
    moved = resumed(request, whole[:k], 1)
    after = from_proto(moved.sampling)
    assert after.constraint == JSON.after(k)
    assert engine.generate([moved.prompt], after)[0] == whole[k:]
    with pytest.raises(InvalidRequestError, match="does not match"):  # a tail the grammar never allowed
        engine.add_request("bad", prompt + [whole[1]] * 3, replace(params, constraint=JSON.after(3)))


@pytest.mark.slow
def test_speculative_decoding_keeps_the_constrained_greedy_output(model: Path, engine: Engine,
                                                                  tmp_path: Path) -> None:
    """Drafts are verified under the grammar's mask: a draft it forbids is rejected, so the output
    is the plain engine's, and it still matches."""
    draft = make_noisy_draft(model, tmp_path / "draft", 0.05)
    spec = _engine(model, speculative_draft_model_path=draft, speculative_num_steps=3)
    prompts = _prompts(engine, 2)
    params = SamplingParams(max_tokens=40, temperature=0, constraint=JSON)
    assert spec.generate(prompts, params) == engine.generate(prompts, params)
    stats = spec.stats()
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0  # drafts ran, some were refused
    for ids in spec.generate(prompts, replace(params, temperature=1.0, seed=7)):
        jsonschema.validate(json.loads(_text(spec, ids)), SCHEMA)
    # The kept tokens' logprobs are of the masked rows verification read, the plain engine's values.
    asked = SamplingParams(max_tokens=20, temperature=0, logprobs=20, constraint=CHOICE)
    plain, lps = _logprobs(engine, "p", prompts[0], asked), _logprobs(spec, "s", prompts[0], asked)
    _assert_masked(spec, lps)
    assert [lp.token_id for lp in lps] == [lp.token_id for lp in plain]
    assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in plain], abs=1e-4)


def test_ngram_speculation_keeps_the_constrained_greedy_output(model: Path, engine: Engine) -> None:
    """NGRAM's lookups (JSON repeats its punctuation) are verified under the grammar's mask too."""
    spec = _engine(model, speculative_algorithm=SpeculativeAlgorithm.NGRAM,
                   speculative_ngram_min_match_window_size=1, speculative_num_steps=3)
    prompts = _prompts(engine, 2)
    params = SamplingParams(max_tokens=40, temperature=0, constraint=JSON)
    assert spec.generate(prompts, params) == engine.generate(prompts, params)
    assert spec.stats()["spec_draft_tokens"] > 0


def test_a_repeated_schema_compiles_once_and_a_bad_one_is_refused(engine: Engine) -> None:
    before = engine.grammars().compiles
    params = SamplingParams(max_tokens=30, temperature=0, constraint=Constraint(ConstraintKind.REGEX, "[0-9]{3}"))
    engine.generate(_prompts(engine, 3), params)
    engine.generate(_prompts(engine, 3), params)
    assert engine.grammars().compiles == before + 1
    with pytest.raises(InvalidRequestError, match="regex"):
        engine.add_request("x", [5, 6], replace(params, constraint=Constraint(ConstraintKind.REGEX, "a(")))
    assert not engine.has_work()


def test_the_bitmask_allows_exactly_its_set_bits_and_nothing_past_its_words() -> None:
    import torch

    from tierserve.model.sampling import SamplingBatch, apply_allowed, sample

    logits = torch.zeros(2, 70)
    allowed = torch.zeros(2, 2, dtype=torch.int32)  # 64 tokens' bits: tokens 64-69 are never allowed
    allowed[0, 0] = 1 << 5
    allowed[1, 1] = -(1 << 31) | (1 << 3)  # tokens 63 and 35 (bit 31 is the sign bit)
    out = apply_allowed(logits, allowed)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [5]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [35, 63]
    assert torch.equal(logits, torch.zeros(2, 70))  # a copy: the caller's logits stay as they were
    batch = SamplingBatch([1.0, 1.0], [1.0, 1.0], [0, 0], [3, None], [0, 0], allowed=allowed)
    for _ in range(5):
        assert sample(logits, batch).tolist()[0] == 5 and sample(logits, batch).tolist()[1] in (35, 63)
