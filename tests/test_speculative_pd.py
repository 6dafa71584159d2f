"""Speculative decoding through prefill-decode disaggregation: the prefill node computes the
draft's KV for the prompt and hands it over with the target's (a packed draft: its layers are
more layers of every page), so the decode node speculates from its first step with the draft
state a single engine would have. Checked by effect: per request, greedy output equals decoding
without speculation and the accepted-draft count equals a single uncached engine's, on a cold
and on a warm cluster (prefixes cached on both nodes), through gRPC as the router drives the
nodes and through ``tierserve up``."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from cluster import NodeProcess, free_port, start_up
from logprob_checks import ids_of
from pd_helpers import CHUNK, DECODE_ARGS, MAX_NEW, NODE_ARGS, PAGE, greedy, reference
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import add_word_tokenizer, make_noisy_draft, make_tiny_model, widen_kv_heads

from tierserve.cli.main import build_parser
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.router import pd_flow

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny llama with a word tokenizer (the API answers in text too)."""
    return add_word_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def draft(tiny: Path, tmp_path_factory) -> Path:
    return make_noisy_draft(tiny, tmp_path_factory.mktemp("draft") / "noisy", 0.03)


def _prompts() -> list[list[int]]:
    """Prompts of one to several prefill chunks, some sharing a prefix."""
    base = [(7 * i) % 380 + 2 for i in range(150)]
    return [base[:40], base[:150], [*base[:70], 9, 8, 7, 6, 5], [(3 * i) % 380 + 2 for i in range(23)]]


def _uncached(model: Path, draft: Path, prompts: list[list[int]]) -> dict[int, tuple[list[int], int]]:
    """Each prompt's (output, accepted drafts) on one engine without a prefix cache, batched."""
    engine = Engine(EngineConfig(model, dtype="float32", page_size=PAGE, chunked_prefill_size=CHUNK,
                                 max_total_tokens=4096, disable_radix_cache=True, speculative_draft_model_path=draft))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[int, tuple[list[int], int]] = {i: ([], 0) for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            ids, _ = out[int(o.request_id)]
            out[int(o.request_id)] = (ids + o.new_token_ids, o.spec_accepted_tokens)
    return out


async def _run_pd(prefill: str, decode: str, rid: str, prompt: list[int]) -> tuple[list[int], int, int]:
    """As the router: Reserve, Prefill, Generate; (output, accepted drafts, prompt tokens D cached)."""
    async with grpc.aio.insecure_channel(prefill) as p, grpc.aio.insecure_channel(decode) as d:
        pair = pd_flow.Pair.connect(p, d)
        done = await pd_flow.prefill(pair, rid, prompt, greedy(), timeout_s=60)
        tokens, accepted = [], 0  # the first chunk carries P's first token
        async for chunk in pd_flow.generate(pair, done, greedy()):
            tokens, accepted = tokens + list(chunk.token_ids), chunk.spec_accepted_tokens
        return tokens, accepted, done.response.cache.cached_tokens


@pytest.fixture(scope="module")
def spec_pair(tiny: Path, draft: Path, tmp_path_factory) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    logs = tmp_path_factory.mktemp("spec-pd-logs")
    flags = ["--model", str(tiny), "--speculative-draft-model-path", str(draft), "--speculative-num-steps", "3"]
    prefill = NodeProcess("prefill", [*flags, *NODE_ARGS], logs / "prefill.log")
    decode = NodeProcess("decode", [*flags, *DECODE_ARGS, "--metrics-port", str(free_port())], logs / "decode.log")
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


def test_pd_handoff_carries_the_draft_state(tiny: Path, draft: Path, spec_pair) -> None:
    prefill, decode = spec_pair
    batch = _prompts()
    plain, want = reference(tiny, batch), _uncached(tiny, draft, batch)

    async def run(tag: str) -> list[tuple[list[int], int, int]]:
        return await asyncio.gather(*(_run_pd(prefill.address, decode.address, f"{tag}{i}", p)
                                      for i, p in enumerate(batch)))

    for tag in ("cold", "warm"):  # warm: both nodes hold the prompts' prefixes with their draft rows
        results = asyncio.run(run(tag))
        assert [tokens for tokens, _, _ in results] == plain == [ids for ids, _ in want.values()]
        assert [accepted for _, accepted, _ in results] == [n for _, n in want.values()], tag
    assert sum(n for _, n in want.values()) > 0
    assert sum(cached for _, _, cached in results) > 0  # the warm round took prefixes from the cache
    # the decode node's draft computed no prompt position: it had the prefill node's draft KV
    assert _metric(decode, "tierserve_spec_prompt_catch_up_tokens_total") == 0
    assert _metric(decode, "tierserve_spec_draft_tokens_total") > 0


def _metric(node: NodeProcess, name: str) -> float:
    port = node.proc.args[node.proc.args.index("--metrics-port") + 1]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@pytest.mark.slow
def test_up_with_a_draft_equals_no_speculation(tiny: Path, draft: Path) -> None:
    """``tierserve up`` (router, prefill node, decode node) with a draft: greedy outputs equal
    decoding without speculation and ``usage.speculative`` the single engine's counts."""
    batch = _prompts()
    plain, want = reference(tiny, batch), _uncached(tiny, draft, batch)
    port = free_port()
    proc, lines = start_up(port, "--model", str(tiny), "--dtype", "float32", "--no-l3", "--page-size",
                           str(PAGE), "--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "4096",
                           "--speculative-draft-model-path", str(draft))
    try:
        for i, prompt in enumerate(batch):
            body = {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                    "return_tokens_as_token_ids": True, "logprobs": 0}
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).json()
            assert ids_of(answer["choices"][0]["logprobs"]["tokens"]) == plain[i]
            assert answer["usage"]["speculative"]["accepted_tokens"] == want[i][1]
    except BaseException:
        print("".join(lines[-60:]))
        raise
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


@pytest.mark.parametrize("role", ["prefill", "decode", "up"])
def test_node_roles_refuse_a_sidecar_draft(tiny: Path, draft: Path, tmp_path: Path, capsys, role: str) -> None:
    """A sidecar draft's pool is not handed over yet: nodes and ``up`` refuse it at start."""
    wide = widen_kv_heads(make_noisy_draft(tiny, tmp_path / "wide", 0.03))
    for flags in (["--speculative-draft-model-path", str(wide)],
                  ["--speculative-draft-model-path", str(draft), "--speculative-draft-layout", "sidecar"]):
        args = build_parser().parse_args([role, "--model", str(tiny), *flags])
        assert args.func(args) == 2
        assert "a packed draft's KV only" in capsys.readouterr().err
