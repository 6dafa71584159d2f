"""Logprobs with speculative decoding: every accepted draft token and the target's own get their
logprob under the target's distribution, equal to those of decoding without speculation; prompt
logprobs and min_tokens work the same with a draft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.tiny_models import make_noisy_draft

from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine


@pytest.fixture(scope="module")
def noisy(tiny_llama: Path, tmp_path_factory) -> Path:
    return make_noisy_draft(tiny_llama, tmp_path_factory.mktemp("draft") / "noisy", 0.03)


def _run(model: Path, draft: Path | None, prompts: list[list[int]], params: SamplingParams) -> dict:
    engine = Engine(EngineConfig(model, dtype="float32", page_size=4, max_total_tokens=2048,
                                 chunked_prefill_size=8, speculative_draft_model_path=draft))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    got: dict = {f"r{i}": {"ids": [], "lp": [], "prompt": None, "accepted": 0} for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            g = got[out.request_id]
            g["ids"] += out.new_token_ids
            g["lp"] += out.logprobs or []
            g["prompt"] = g["prompt"] or out.prompt_logprobs
            g["accepted"] = out.spec_accepted_tokens
    return got


def _close(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is y
            continue
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_logprobs_with_speculation_equal_those_without(tiny_llama: Path, noisy: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 384, (9 + 4 * i,), generator=gen).tolist() for i in range(3)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    plain, spec = _run(tiny_llama, None, prompts, params), _run(tiny_llama, noisy, prompts, params)
    for rid, want in plain.items():
        got = spec[rid]
        assert got["ids"] == want["ids"] and len(got["lp"]) == len(got["ids"]) == 16
        assert [e.token_id for e in got["lp"]] == got["ids"]
        _close(got["lp"], want["lp"])
        _close(got["prompt"], want["prompt"])
    assert sum(g["accepted"] for g in spec.values()) > 0  # several tokens per step carried logprobs


def test_min_tokens_with_speculation_equals_without(tiny_llama: Path, noisy: Path) -> None:
    """Speculation waits until min_tokens no longer masks EOS: the output equals plain decoding's."""
    prompts = [[5, 6, 7, 8, 9, 10]]
    free = _run(tiny_llama, None, prompts, SamplingParams(max_tokens=24, temperature=0))["r0"]["ids"]
    params = SamplingParams(max_tokens=24, temperature=0, min_tokens=12, stop_token_ids=free[:1])  # stops at once
    want = _run(tiny_llama, None, prompts, params)["r0"]
    got = _run(tiny_llama, noisy, prompts, params)["r0"]
    assert got["ids"] == want["ids"] and len(got["ids"]) >= 12
    assert free[0] not in got["ids"][:11] and got["accepted"] > 0
