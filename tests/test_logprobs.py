"""Logprobs from the engine equal transformers' log-softmax of the same model's logits: prompt
tokens (echo), sampled tokens and their top-k alternatives, with and without cache hits, over
chunked prefill; min_tokens masks EOS and stop ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierserve.core.outputs import FinishReason, RequestOutput, TokenLogprob
from tierserve.core.sampling import InvalidRequestError, SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

TOL = 1e-4
K = 5


def hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 log-softmax of transformers' logits: row i predicts token i+1."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches(got: TokenLogprob, row: torch.Tensor, k: int) -> None:
    """``got`` scores its token as ``row`` does, and its top-k are ``row``'s k best."""
    assert abs(got.logprob - float(row[got.token_id])) < TOL
    values, ids = row.topk(k)
    assert [t for t, _ in got.top] == ids.tolist()
    assert max(abs(v - float(w)) for (_, v), w in zip(got.top, values, strict=True)) < TOL if k else got.top == ()


def run(engine: Engine, rid: str, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def _engine(model_dir: Path, chunk: int = 7, page_size: int = 4) -> Engine:
    return Engine(EngineConfig(model_dir, dtype="float32", page_size=page_size, max_total_tokens=2048,
                               chunked_prefill_size=chunk))


def _prompt(n: int, seed: int = 3) -> list[int]:
    return torch.randint(2, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


ECHO = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=K, prompt_logprobs=K)


def check_request(model_dir: Path, prompt: list[int], outs: list[RequestOutput], k: int = K) -> None:
    tokens = [t for o in outs for t in o.new_token_ids]
    ref = hf_logprobs(model_dir, prompt + tokens)
    prompt_lps = outs[0].prompt_logprobs
    assert prompt_lps is not None and len(prompt_lps) == len(prompt) and prompt_lps[0] is None
    for i, lp in enumerate(prompt_lps[1:], start=1):
        assert lp.token_id == prompt[i]
        assert_matches(lp, ref[i - 1], k)
    sampled = [lp for o in outs for lp in o.logprobs or []]
    assert [lp.token_id for lp in sampled] == tokens
    for j, lp in enumerate(sampled):
        assert_matches(lp, ref[len(prompt) - 1 + j], k)
    assert all(o.prompt_logprobs is None for o in outs[1:])


@pytest.mark.parametrize("chunk", [7, 2048])
def test_prompt_and_sampled_logprobs_match_hf(tiny_model: Path, chunk: int) -> None:
    engine = _engine(tiny_model, chunk)
    prompt = _prompt(30)
    check_request(tiny_model, prompt, run(engine, "a", prompt, ECHO))
    assert engine.stats()["kv_pages_used"] == 0


def test_cache_hits_are_recomputed_for_prompt_logprobs(tiny_llama: Path) -> None:
    """A cached prompt serves KV to a request without prompt logprobs; one with them computes the
    whole prompt again (cached_tokens 0) and its values equal the reference."""
    engine = _engine(tiny_llama)
    prompt = _prompt(25, seed=5)
    run(engine, "warm", prompt, SamplingParams(max_tokens=2, temperature=0))
    hit = run(engine, "hit", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2))
    assert hit[0].cached_tokens >= 20
    ref = hf_logprobs(tiny_llama, prompt + [t for o in hit for t in o.new_token_ids])
    for j, lp in enumerate(lp for o in hit for lp in o.logprobs):
        assert_matches(lp, ref[len(prompt) - 1 + j], 2)
    echo = run(engine, "echo", prompt, ECHO)
    assert echo[0].cached_tokens == 0
    check_request(tiny_llama, prompt, echo)


def test_prompt_logprobs_from_a_start_position_use_the_cache_before_it(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    prompt = _prompt(30, seed=6)
    run(engine, "warm", prompt, SamplingParams(max_tokens=1, temperature=0))
    outs = run(engine, "late", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2,
                                                     prompt_logprobs=2, prompt_logprobs_start=21))
    assert outs[0].cached_tokens == 20  # pages of 4 up to position 20, whose logits score token 21
    lps = outs[0].prompt_logprobs
    assert len(lps) == 30 and lps[:21] == [None] * 21
    ref = hf_logprobs(tiny_llama, prompt)
    for i in range(21, 30):
        assert lps[i].token_id == prompt[i]
        assert_matches(lps[i], ref[i - 1], 2)


def test_batched_with_other_requests_and_k0(tiny_llama: Path) -> None:
    """Requests with and without logprobs in one batch; k = 0 gives the token's logprob alone."""
    engine = _engine(tiny_llama, chunk=16)
    prompts = {"a": _prompt(20, 1), "b": _prompt(13, 2), "c": _prompt(9, 4)}
    params = {"a": ECHO, "b": SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
              "c": SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, params[rid])
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in prompts}
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].append(o)
    check_request(tiny_llama, prompts["a"], outs["a"])
    check_request(tiny_llama, prompts["c"], outs["c"], k=0)
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outs["b"])


def test_logprobs_are_raw_not_tempered(tiny_llama: Path) -> None:
    """Sampling at temperature 0.5 reports the model's own distribution (vLLM's raw_logprobs)."""
    engine = _engine(tiny_llama)
    prompt = _prompt(12, 8)
    outs = run(engine, "t", prompt, SamplingParams(max_tokens=5, temperature=0.5, seed=1, ignore_eos=True,
                                                  logprobs=3))
    ref = hf_logprobs(tiny_llama, prompt + [t for o in outs for t in o.new_token_ids])
    for j, lp in enumerate(lp for o in outs for lp in o.logprobs):
        assert_matches(lp, ref[len(prompt) - 1 + j], 3)


def test_min_tokens_masks_stop_ids(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    prompt = _prompt(10, 9)
    first = run(engine, "g", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].new_token_ids[0]
    stops = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[first])
    assert [t for o in run(engine, "s", prompt, stops) for t in o.new_token_ids] == [first]
    held = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[first], min_tokens=4,
                          logprobs=1)
    outs = run(engine, "m", prompt, held)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(tokens) >= 4 and first not in tokens[:4]
    assert outs[0].logprobs[0].top[0][0] == first  # the logprobs still see the masked token: raw
    assert outs[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


@pytest.mark.parametrize("bad", [dict(logprobs=21), dict(prompt_logprobs=-1), dict(min_tokens=9)])
def test_bad_values_are_refused(bad: dict) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=8, **bad)


def test_builtin_model_logprobs_match_hf(builtin_model: Path) -> None:
    engine = Engine(EngineConfig(builtin_model, dtype="float32", page_size=16, max_total_tokens=2048,
                                 chunked_prefill_size=16))
    prompt = engine.tokenizer.encode("The capital of France is Paris, and the capital of Italy is").ids
    check_request(builtin_model, prompt, run(engine, "b", prompt, SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True, logprobs=K, prompt_logprobs=K)))


def test_preempted_requests_report_each_logprob_once_and_right(tiny_llama: Path) -> None:
    """A pool too small for both requests preempts one mid-generation; recomputed, it neither
    repeats nor changes a prompt or sampled logprob."""
    engine = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=4, max_total_tokens=80,
                                 chunked_prefill_size=8))
    prompts = {"a": _prompt(30, 11), "b": _prompt(30, 12)}
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in prompts}
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].append(o)
    assert engine.scheduler.num_preemptions > 0
    for rid, p in prompts.items():
        check_request(tiny_llama, p, outs[rid], k=2)
