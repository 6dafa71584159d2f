"""NGRAM speculation (prompt lookup, docs/speculative.md): drafts from the request's own tokens, no
draft model. Lossless greedy output (batched, chunked prefill, preemption, abort), drafts accepted
where the text repeats and none proposed where it does not (usage and /metrics), the matcher equal
to a naive search within its window and its index bounded by it, and bad flags refused at start."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from helpers.engine_runs import assert_no_pages_held, spread_prompts
from helpers.logprob_checks import ids_of
from helpers.tiny_models import make_looping_model

from tierserve.api.engine_backend import create_engine_app
from tierserve.cli.main import build_parser
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig, SpeculativeAlgorithm
from tierserve.engine.engine import Engine
from tierserve.engine.loop import EngineLoop
from tierserve.engine.spec.ngram import PromptLookup

NGRAM = SpeculativeAlgorithm.NGRAM
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def looping(tiny_llama: Path, tmp_path_factory) -> Path:
    """The tiny llama without attention: its greedy text runs into a cycle, which lookups predict."""
    return make_looping_model(tiny_llama, tmp_path_factory.mktemp("looping") / "model")


@pytest.fixture(scope="module")
def wandering(tiny_llama: Path, tmp_path_factory) -> Path:
    """The tiny llama with attention scaled down: runs of tokens recur, but not always the same way."""
    return make_looping_model(tiny_llama, tmp_path_factory.mktemp("wandering") / "model", 0.02)


def _engine(model: Path, ngram: bool = True, tokens: int = 4096, **kw) -> Engine:
    spec = {"speculative_algorithm": NGRAM} if ngram else {}
    return Engine(EngineConfig(model, dtype="float32", page_size=4, max_total_tokens=tokens, **spec, **kw))


def _naive(seq: list[int], shortest: int, longest: int, window: int, k: int) -> list[int]:
    """The k tokens after the latest occurrence of seq's last n tokens (longest n first) that ends
    among the window's positions with a continuation: what ``PromptLookup`` must find."""
    total = len(seq)
    for n in range(min(longest, total - 1), shortest - 1, -1):
        for j in range(total - 2, max(-1, total - 2 - window), -1):
            if j - n + 1 >= 0 and seq[j - n + 1: j + 1] == seq[total - n:]:
                return seq[j + 1: j + 1 + k]
    return []


def test_lookup_equals_a_naive_search_within_its_window() -> None:
    rng = random.Random(3)
    for _ in range(300):
        vocab, window, (shortest, longest) = rng.choice([3, 5, 20]), rng.choice([6, 10, 40]), rng.choice(
            [(1, 3), (2, 5), (3, 3)])
        lookup = PromptLookup(shortest, longest, window)
        prompt, output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))], []
        for _ in range(25):
            k = rng.randrange(1, 5)
            assert lookup.propose(prompt, output, k) == _naive(prompt + output, shortest, longest, window, k)
            output += [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]  # verification appends 1..k+1


def test_lookup_index_stays_within_its_window() -> None:
    """A long prompt: only its latest ``window`` positions are indexed (memory and the first
    lookup's time), and appending keeps the index there; what left the window is not found."""
    window, sizes = 64, (2, 4)
    prompt = list(range(10_000, 13_000))  # no repeats
    assert PromptLookup(*sizes, window).propose([7, 8, *prompt, 7, 8], [], 3) == []  # [7, 8] is 3,000 tokens back
    lookup, bound = PromptLookup(*sizes, window), window * (sizes[1] - sizes[0] + 1)
    output: list[int] = []
    for i in range(500):
        output.append(20_000 + i)
        lookup.propose(prompt, output, 3)
        assert 0 < len(lookup.index) <= bound
    a, b, expected = output[-30], output[-29], output[-28:-25]
    output += [a, b]
    assert lookup.propose(prompt, output, 3) == expected  # inside the window: found


@pytest.mark.parametrize("sizes", [(1, 3), (2, 5)])
def test_greedy_batched_chunked_equals_no_speculation(tiny_llama: Path, wandering: Path, sizes: tuple[int, int]
                                                      ) -> None:
    """On the tiny llama (lookups rejected) and a wandering one (some accepted, some not): the output
    is the target's, and the lookup indexes go with their requests."""
    prompts = spread_prompts(6, 9)
    kw = dict(speculative_ngram_min_match_window_size=sizes[0], speculative_ngram_max_match_window_size=sizes[1],
              chunked_prefill_size=8, speculative_num_steps=4)
    for model in (tiny_llama, wandering):
        expected = _engine(model, ngram=False).generate(prompts, GREEDY)
        engine = _engine(model, **kw)
        assert engine.generate(prompts, GREEDY) == expected
        c = engine.spec.counters
        assert c.verify_steps > 0 and c.draft_tokens > 0 and c.prompt_catch_up_tokens == 0
        if model == wandering:
            assert 0 < c.accepted_tokens < c.draft_tokens, c  # both paths of verification
        assert_no_pages_held(engine)
        engine.generate([[5, 6]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert set(engine.spec.drafter.lookups) <= {"gen-6"}  # the finished requests' indexes are gone


def test_greedy_under_preemption_and_abort(wandering: Path) -> None:
    prompts = spread_prompts(8, 12, seed=9)
    expected = _engine(wandering, ngram=False).generate(prompts, GREEDY)
    small = _engine(wandering, tokens=96, speculative_num_steps=4)
    assert small.generate(prompts, GREEDY) == expected
    assert small.scheduler.num_preemptions > 0 and small.spec.counters.accepted_tokens > 0
    assert_no_pages_held(small)
    for i, prompt in enumerate(prompts[:3]):
        small.add_request(f"r{i}", prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    verified = small.spec.counters.verify_steps
    while small.spec.counters.verify_steps < verified + 4:
        small.step()
    assert all(small.abort(f"r{i}") is not None for i in range(3))
    assert not small.has_work()
    assert_no_pages_held(small)


def _with_logprobs(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[tuple]:
    """Per prompt, batched: (ids, logprobs, prompt logprobs)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    got: dict[str, tuple[list, list, list]] = {f"r{i}": ([], [], []) for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            ids, lps, prompt_lps = got[out.request_id]
            ids += out.new_token_ids
            lps += out.logprobs or []
            prompt_lps += [] if prompt_lps else out.prompt_logprobs or []
    return list(got.values())


def test_logprobs_equal_those_without_speculation(wandering: Path) -> None:
    """Tokens kept from accepted lookups carry the target's logprobs and top alternatives."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    prompts = spread_prompts(3, 9, seed=4)
    engine = _engine(wandering, speculative_num_steps=4)
    plain = _with_logprobs(_engine(wandering, ngram=False), prompts, params)
    spec = _with_logprobs(engine, prompts, params)
    assert engine.spec.counters.accepted_tokens > 0
    for (ids, lps, prompt_lps), (want_ids, want_lps, want_prompt) in zip(spec, plain, strict=True):
        assert ids == want_ids and [e.token_id for e in lps] == ids
        for got, want in zip([*lps, *prompt_lps], [*want_lps, *want_prompt], strict=True):
            assert (got is None) == (want is None)
            if got is not None:
                assert abs(got.logprob - want.logprob) < 1e-4 and [t for t, _ in got.top] == [t for t, _ in want.top]


def test_seeded_sampling_is_reproducible(looping: Path) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.5, top_p=0.9, seed=123, ignore_eos=True)
    prompts = [_repeating(looping), *spread_prompts(2, 8)]
    first = _engine(looping).generate(prompts, params)
    engine = _engine(looping)
    assert engine.generate(list(reversed(prompts)), params) == list(reversed(first))
    assert engine.spec.counters.draft_tokens > 0


def _repeating(model: Path) -> list[int]:
    """A prompt ending in text the model repeats: a seed prompt and 32 tokens of its greedy
    continuation, which has run into its cycle by then (checked)."""
    seed = spread_prompts(1, 10, seed=21)[0]
    text = _engine(model, ngram=False).generate([seed], GREEDY)[0][:32]
    assert len(set(text[16:])) < 16, text
    return seed + text


def _no_repeat(model: Path, max_tokens: int) -> list[int]:
    """A prompt whose text, with its greedy continuation, repeats no 2 tokens in a row (checked)."""
    prompt = list(range(40, 80))
    out = _engine(model, ngram=False).generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                          ignore_eos=True))[0]
    seq = prompt + out
    pairs = list(itertools.pairwise(seq))
    assert len(set(pairs)) == len(pairs), "the no-repeat prompt repeats: pick another"
    return prompt


def test_api_reports_acceptance_on_repeats_and_no_drafts_without(looping: Path, tiny_llama: Path) -> None:
    """Through the OpenAI API: a repeating prompt's drafts are accepted (usage and /metrics); a
    prompt whose text never repeats a 2-gram gets no drafts (the default shortest match is 2)."""
    repeating = _repeating(looping)
    plain = _engine(looping, ngram=False).generate([repeating], SamplingParams(max_tokens=16, temperature=0,
                                                                                ignore_eos=True))[0]
    loop = EngineLoop(_engine(looping, speculative_num_steps=3)).start()
    try:
        with TestClient(create_engine_app(loop, None, "tiny")) as client:
            body = {"prompt": repeating, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 0,
                    "return_tokens_as_token_ids": True}
            answer = client.post("/v1/completions", json=body).json()
            metrics = client.get("/metrics").text
    finally:
        loop.stop()
    assert ids_of(answer["choices"][0]["logprobs"]["tokens"]) == plain
    spec = answer["usage"]["speculative"]
    assert 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
    assert f"tierserve_spec_accepted_tokens_total {float(spec['accepted_tokens'])}" in metrics
    quiet = _no_repeat(tiny_llama, 12)
    loop = EngineLoop(_engine(tiny_llama)).start()
    try:
        with TestClient(create_engine_app(loop, None, "tiny")) as client:
            body = {"prompt": quiet, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            usage = client.post("/v1/completions", json=body).json()["usage"]
            metrics = client.get("/metrics").text
    finally:
        loop.stop()
    assert usage["completion_tokens"] == 12 and "speculative" not in usage
    assert "tierserve_spec_draft_tokens_total 0.0" in metrics


def test_engine_index_of_a_long_prompt_is_capped(long_llama: Path) -> None:
    """A 1,500-token prompt with ``--speculative-ngram-window 128``: the running request's index
    never holds more than the window's n-grams."""
    engine = Engine(EngineConfig(long_llama, dtype="float32", page_size=4, max_total_tokens=4096,
                                 speculative_algorithm=NGRAM, speculative_ngram_window=128))
    prompt = [2 + (i * 7919) % 380 for i in range(1500)]
    engine.add_request("long", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    sizes = []
    while engine.has_work():
        engine.step()
        lookups = engine.spec.drafter.lookups
        sizes += [len(lookups["long"][1].index)] if "long" in lookups else []
    low, high, _ = engine.config.ngram_sizes
    assert sizes and max(sizes) <= 128 * (high - low + 1)


@pytest.mark.parametrize("flags, message", [
    (["--speculative-algorithm", "NGRAM", "--speculative-draft-model-path", "MODEL"], "takes no"),
    (["--speculative-algorithm", "STANDALONE"], "needs --speculative-draft-model-path"),
    (["--speculative-ngram-window", "64"], "need --speculative-algorithm NGRAM"),
    (["--speculative-algorithm", "ngram", "--speculative-ngram-min-match-window-size", "4",
      "--speculative-ngram-max-match-window-size", "3"], "at most --speculative-ngram-max-match-window-size"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "0"], "at least 1"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-window", "5"], "must exceed"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "4"],
     "must be --speculative-num-steps + 1"),
])
def test_bad_ngram_flags_are_refused_at_start(tiny_llama: Path, capsys, flags: list[str], message: str) -> None:
    for command in ("serve", "decode"):
        args = build_parser().parse_args([command, "--model", str(tiny_llama),
                                          *[str(tiny_llama) if f == "MODEL" else f for f in flags]])
        assert args.func(args) == 2
        assert message in capsys.readouterr().err


def test_unknown_algorithm_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--speculative-algorithm", "EAGLE3"])  # not implemented
    assert exit_.value.code == 2
    assert "--speculative-algorithm" in capsys.readouterr().err
