"""Speculative decoding with a draft model: lossless greedy output (batched, chunked prefill,
preemption, abort, prefix cache hits), the target's distribution when sampling, pages never leaked,
flags refused clearly, and the counters in usage and /metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from helpers.engine_runs import assert_no_pages_held, spread_prompts
from helpers.tiny_models import make_noisy_draft, make_tiny_model
from safetensors.torch import load_file

from tierserve.api.engine_backend import create_engine_app
from tierserve.cli.main import build_parser
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.loop import EngineLoop
from tierserve.model.draft import BUILTIN_DRAFT_LAYERS, derive_draft

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def drafts(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    """Drafts for the tiny llama: itself (every draft accepted), a noisy copy (about half accepted)
    and its first layer (derived as ``model fetch --draft`` derives one; almost never accepted)."""
    root = tmp_path_factory.mktemp("drafts")
    return {"self": tiny_llama, "noisy": make_noisy_draft(tiny_llama, root / "noisy", 0.03),
            "layer0": derive_draft(tiny_llama, root / "layer0", (0,))}


def _engine(model: Path, draft: Path | None, tokens: int = 2048, **kw) -> Engine:
    return Engine(EngineConfig(model, dtype="float32", page_size=4, max_total_tokens=tokens,
                               speculative_draft_model_path=draft, **kw))


@pytest.mark.parametrize("name", ["self", "noisy", "layer0"])
def test_greedy_batched_chunked_output_equals_no_speculation(tiny_llama: Path, drafts: dict[str, Path],
                                                              name: str) -> None:
    prompts = spread_prompts(6, 9)
    expected = _engine(tiny_llama, None).generate(prompts, GREEDY)
    engine = _engine(tiny_llama, drafts[name], chunked_prefill_size=8, speculative_num_steps=3)
    assert engine.generate(prompts, GREEDY) == expected
    c = engine.spec.counters
    assert c.verify_steps > 0 and c.draft_tokens > 0
    if name == "self":
        assert c.accepted_tokens == c.draft_tokens
    if name == "noisy":
        assert 0 < c.accepted_tokens < c.draft_tokens
    assert_no_pages_held(engine)


def test_greedy_under_preemption_equals_no_speculation(tiny_llama: Path, drafts: dict[str, Path]) -> None:
    prompts = spread_prompts(8, 12, seed=9)
    expected = _engine(tiny_llama, None).generate(prompts, GREEDY)
    small = _engine(tiny_llama, drafts["noisy"], tokens=96, speculative_num_steps=4)
    assert small.generate(prompts, GREEDY) == expected
    assert small.scheduler.num_preemptions > 0 and small.spec.counters.accepted_tokens > 0
    assert_no_pages_held(small)


def test_prefix_cache_hit_keeps_output_and_acceptance(tiny_llama: Path, drafts: dict[str, Path]) -> None:
    """A prompt whose prefix the target reads from the cache: the draft's KV for that prefix comes
    with it (tests/test_speculative_cache.py), so output and accepted drafts equal a cold engine's."""
    prompt = spread_prompts(1, 40, seed=11)[0]
    cold = _engine(tiny_llama, drafts["noisy"])
    cold.add_request("cold", prompt, GREEDY)
    cold_out = _outputs(cold)["cold"]
    warm = _engine(tiny_llama, drafts["noisy"])
    warm.generate([[*prompt[:30], 7, 8, 9]], GREEDY)  # leaves 28 prompt tokens (7 pages) in the tree
    warm.add_request("warm", prompt, GREEDY)
    warm_out = _outputs(warm)["warm"]
    assert warm_out.cached_tokens >= 28
    assert warm_out.new_token_ids == cold_out.new_token_ids
    assert warm_out.spec_accepted_tokens == cold_out.spec_accepted_tokens > 0
    assert_no_pages_held(warm)


def test_host_hit_keeps_output_and_acceptance(tiny_llama: Path, drafts: dict[str, Path]) -> None:
    """The prefix comes back from L2 with its draft KV, so output and accepted drafts equal the
    first (uncached) run's."""
    engine = _engine(tiny_llama, drafts["noisy"], enable_hierarchical_cache=True)
    prompt = spread_prompts(1, 40, seed=13)[0]
    engine.add_request("first", prompt, GREEDY)
    first = _outputs(engine)["first"]
    engine.cache.wait_background()
    engine.cache.evict(engine.allocator.num_pages)  # only L2 holds the prompt now
    engine.add_request("again", prompt, GREEDY)
    again = _outputs(engine)["again"]
    assert again.cached_by_tier.get("host", 0) >= 36, again.cached_by_tier
    assert again.new_token_ids == first.new_token_ids
    assert again.spec_accepted_tokens == first.spec_accepted_tokens > 0
    engine.cache.wait_background()
    assert_no_pages_held(engine)


def test_abort_midway_returns_every_page(tiny_llama: Path, drafts: dict[str, Path]) -> None:
    engine = _engine(tiny_llama, drafts["noisy"], speculative_num_steps=4)
    for i, prompt in enumerate(spread_prompts(3, 10)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    while engine.spec.counters.verify_steps < 6:
        engine.step()
    assert engine.abort("r1").finish_reason.value == "abort"
    engine.step()
    engine.abort("r0")
    engine.abort("r2")
    assert not engine.has_work()
    assert_no_pages_held(engine)


def test_stop_token_inside_accepted_drafts_ends_there(tiny_llama: Path, drafts: dict[str, Path]) -> None:
    prompt = spread_prompts(1, 12, seed=2)[0]
    full = _engine(tiny_llama, None).generate([prompt], GREEDY)[0]
    stop = full[7]
    params = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop], ignore_eos=True)
    engine = _engine(tiny_llama, drafts["self"], speculative_num_steps=5)
    assert engine.generate([prompt], params)[0] == full[: full.index(stop) + 1]
    assert_no_pages_held(engine)


def test_seeded_sampling_is_reproducible(tiny_llama: Path, drafts: dict[str, Path]) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    prompts = spread_prompts(3, 8)
    first = _engine(tiny_llama, drafts["noisy"]).generate(prompts, params)
    again = _engine(tiny_llama, drafts["noisy"]).generate(list(reversed(prompts)), params)
    assert first == list(reversed(again))


def test_usage_and_metrics_report_acceptance(tiny_llama: Path, drafts: dict[str, Path]) -> None:
    loop = EngineLoop(_engine(tiny_llama, drafts["self"], speculative_num_steps=3)).start()
    try:
        with TestClient(create_engine_app(loop, None, "tiny")) as client:
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 9, "temperature": 0, "ignore_eos": True}
            usage = client.post("/v1/completions", json=body).json()["usage"]
            metrics = client.get("/metrics").text
    finally:
        loop.stop()
    # 8 tokens after the prefill's first: two verifications of 3 drafts, all accepted, plus a bonus each
    assert usage["speculative"] == {"draft_tokens": 6, "accepted_tokens": 6}
    assert "tierserve_spec_draft_tokens_total 6.0" in metrics
    assert "tierserve_spec_acceptance_rate 1.0" in metrics
    assert "tierserve_spec_accepted_tokens_per_step 4.0" in metrics


def _outputs(engine: Engine) -> dict:
    merged: dict = {}
    while engine.has_work():
        for out in engine.step():
            if out.request_id in merged:
                out.new_token_ids = merged[out.request_id].new_token_ids + out.new_token_ids
            merged[out.request_id] = out
    return merged


@pytest.mark.parametrize("flags, message", [
    (["--speculative-draft-model-path", "/nonexistent"], "is not a model folder"),
    (["--speculative-num-steps", "2"], "need --speculative-draft-model-path"),
    (["--speculative-draft-model-path", "DRAFT", "--speculative-num-steps", "2",
      "--speculative-num-draft-tokens", "4"], "must be --speculative-num-steps + 1"),
    (["--speculative-draft-model-path", "ODD_HEADS", "--tp-size", "2"],
     "the draft model cannot be split like the target: tensor-parallel size 2 does not divide the model's 3"),
    (["--speculative-draft-model-path", "OTHER_VOCAB"], "vocabulary (200 tokens) differs"),
])
def test_bad_speculative_flags_are_refused_at_start(tiny_llama: Path, drafts: dict[str, Path], tmp_path: Path,
                                                    capsys, flags: list[str], message: str) -> None:
    other = make_tiny_model("llama", tmp_path / "other", vocab_size=200) if "OTHER_VOCAB" in flags else None
    odd = make_tiny_model("llama", tmp_path / "odd", heads=3, kv_heads=3, hidden_size=48) \
        if "ODD_HEADS" in flags else None  # a draft TP 2 cannot split
    names = {"DRAFT": str(drafts["layer0"]), "OTHER_VOCAB": str(other), "ODD_HEADS": str(odd)}
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama), *[names.get(f, f) for f in flags]])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_builtin_draft_from_model_fetch_is_lossless(builtin_model: Path, tmp_path: Path, capsys) -> None:
    """``tierserve model fetch --draft`` prints a folder holding the built-in model's chosen layers;
    speculating with it leaves greedy output unchanged, batched."""
    args = build_parser().parse_args(["model", "fetch", "--draft", "--cache-dir", str(tmp_path)])
    assert args.func(args) == 0
    draft = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == len(BUILTIN_DRAFT_LAYERS)
    ours, theirs = load_file(str(draft / "model.safetensors")), load_file(str(builtin_model / "model.safetensors"))
    last = len(BUILTIN_DRAFT_LAYERS) - 1
    name = "model.layers.{}.mlp.down_proj.weight"
    assert torch.equal(ours[name.format(last)], theirs[name.format(BUILTIN_DRAFT_LAYERS[-1])])
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 378, 2634, 15205, 17, 216, 216], [1, 33, 30, 34, 30, 35, 30]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = Engine(EngineConfig(builtin_model, dtype="float32", max_total_tokens=2048)).generate(prompts, params)
    engine = Engine(EngineConfig(builtin_model, dtype="float32", max_total_tokens=2048,
                                 speculative_draft_model_path=draft, speculative_num_draft_tokens=4))
    assert engine.generate(prompts, params) == expected
    assert engine.spec.counters.draft_tokens > 0


def test_bench_reads_speculative_usage_into_its_report() -> None:
    from tierserve.bench.client import _read_usage
    from tierserve.bench.records import RequestRecord
    from tierserve.bench.report import Report

    records = [RequestRecord(i, {}, 0.0, ok=True) for i in range(2)]
    for record, (drafted, accepted) in zip(records, [(10, 4), (6, 0)], strict=True):
        _read_usage({"prompt_tokens": 5, "completion_tokens": 9,
                     "speculative": {"draft_tokens": drafted, "accepted_tokens": accepted}}, record)
    report = Report(records, 1.0, {})
    assert report.summary()["speculative"] == {"draft_tokens": 16, "accepted_tokens": 4, "acceptance_rate": 0.25}
    assert "speculative: 25.0% of 16 draft tokens accepted" in report.table()
    _read_usage({"prompt_tokens": 5, "completion_tokens": 9}, records[0])  # a server without a draft
    _read_usage({"prompt_tokens": 5, "completion_tokens": 9}, records[1])
    assert Report(records, 1.0, {}).summary()["speculative"] is None
