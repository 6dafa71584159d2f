"""Speculative decoding on the built-in model (SmolLM2-135M) with the draft ``tierserve model fetch
--draft`` derives from it: greedy output batched equals decoding without speculation, on a single
engine and through prefill-decode disaggregation, where the decode node speculates from its first
step with the draft KV the prefill node handed over (docs/speculative.md); and NGRAM (prompt lookup) on
text that repeats: greedy output equal, drafts accepted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers.pd_nodes import CHUNK, DECODE_ARGS, NODE_ARGS, PAGE, greedy, node_metric
from helpers.processes import NodeProcess, free_port
from tokenizers import Tokenizer

from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig, SpeculativeAlgorithm
from tierserve.engine.engine import Engine
from tierserve.model.draft import BUILTIN_DRAFT_LAYERS, derive_draft
from tierserve.router import pd_flow

pytestmark = pytest.mark.slow

MAX_NEW = 16
TEXTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
         "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter "
         "and his three children. Every morning the woodcutter walked into the forest with his axe, and every "
         "evening he came back with a bundle of wood on his back. One day, as the sun was setting,",
         "1, 2, 3, 4, 5, 6, 7, 8,"]
Outcome = dict[int, tuple[list[int], int]]  # per request: (output ids, accepted draft tokens)


@pytest.fixture(scope="module")
def draft(builtin_model: Path, tmp_path_factory) -> Path:
    """The built-in model's draft, derived as ``model fetch --draft`` derives it (the CLI's own
    path is covered by tests/test_speculative.py)."""
    return derive_draft(builtin_model, tmp_path_factory.mktemp("builtin-draft") / "draft", BUILTIN_DRAFT_LAYERS)


@pytest.fixture(scope="module")
def prompts(builtin_model: Path) -> list[list[int]]:
    """Real text of one to two prefill chunks, so the draft has something to agree on."""
    tokenizer = Tokenizer.from_file(str(builtin_model / "tokenizer.json"))
    ids = [tokenizer.encode(text).ids for text in TEXTS]
    assert max(map(len, ids)) > CHUNK  # one prompt's prefill (and handoff) spans two chunks
    return ids


def _engine(model: Path, draft: Path | None, **kw) -> Engine:
    return Engine(EngineConfig(model, dtype="float32", page_size=PAGE, chunked_prefill_size=CHUNK,
                               max_total_tokens=4096, speculative_draft_model_path=draft, **kw))


def _run(engine: Engine, prompts: list[list[int]]) -> Outcome:
    """All ``prompts`` added at once and stepped together until done."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    out: Outcome = {}
    while engine.has_work():
        for o in engine.step():
            ids, _ = out.get(int(o.request_id), ([], 0))
            out[int(o.request_id)] = (ids + o.new_token_ids, o.spec_accepted_tokens)
    return dict(sorted(out.items()))


@pytest.fixture(scope="module")
def plain(builtin_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs without speculation, batched."""
    return [ids for ids, _ in _run(_engine(builtin_model, None), prompts).values()]


@pytest.fixture(scope="module")
def speculated(builtin_model: Path, draft: Path, prompts: list[list[int]]) -> Outcome:
    """Greedy outputs and accepted counts of one engine speculating with the derived draft, batched."""
    engine = _engine(builtin_model, draft)
    out = _run(engine, prompts)
    assert engine.spec.counters.verify_steps > 0
    assert engine.spec.counters.prompt_catch_up_tokens == 0
    return out


def test_single_engine_batched_equals_no_speculation(plain: list[list[int]], speculated: Outcome) -> None:
    assert [ids for ids, _ in speculated.values()] == plain
    assert all(len(ids) == MAX_NEW for ids in plain)
    assert sum(n for _, n in speculated.values()) > 0  # the derived draft is really used, and right at times


@pytest.fixture(scope="module")
def pd_pair(builtin_model: Path, draft: Path, tmp_path_factory) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    """A prefill and a decode node serving the built-in model with its derived draft."""
    logs = tmp_path_factory.mktemp("spec-builtin-pd")
    flags = ["--model", str(builtin_model), "--speculative-draft-model-path", str(draft)]
    prefill = NodeProcess("prefill", [*flags, *NODE_ARGS], logs / "prefill.log")
    decode = NodeProcess("decode", [*flags, *DECODE_ARGS, "--metrics-port", str(free_port())], logs / "decode.log")
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


async def _run_pd(prefill: str, decode: str, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """As the router: Reserve, Prefill, Generate; (output, accepted drafts)."""
    async with grpc.aio.insecure_channel(prefill) as p, grpc.aio.insecure_channel(decode) as d:
        pair = pd_flow.Pair.connect(p, d)
        done = await pd_flow.prefill(pair, rid, prompt, greedy(MAX_NEW), timeout_s=120)
        tokens, accepted = [], 0  # the first chunk carries P's first token
        async for chunk in pd_flow.generate(pair, done, greedy(MAX_NEW)):
            tokens, accepted = tokens + list(chunk.token_ids), chunk.spec_accepted_tokens
        return tokens, accepted


@pytest.mark.integration
def test_pd_batched_equals_no_speculation(pd_pair, prompts: list[list[int]], plain: list[list[int]],
                                          speculated: Outcome) -> None:
    """Concurrent requests (each node batches them): outputs equal no speculation, accepted counts
    equal the single engine's, and the decode node's draft computed no prompt position itself."""
    prefill, decode = pd_pair

    async def run() -> list[tuple[list[int], int]]:
        return await asyncio.gather(*(_run_pd(prefill.address, decode.address, f"b{i}", p)
                                      for i, p in enumerate(prompts)))

    results = asyncio.run(run())
    assert [tokens for tokens, _ in results] == plain
    assert [n for _, n in results] == [n for _, n in speculated.values()]
    assert node_metric(decode, "tierserve_spec_prompt_catch_up_tokens_total") == 0
    assert node_metric(decode, "tierserve_spec_draft_tokens_total") > 0



CODE = """def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1
"""


def test_ngram_on_a_repeated_block_equals_no_speculation(builtin_model: Path, prompts: list[list[int]],
                                                         plain: list[list[int]]) -> None:
    """A code block given twice in code fences and a third fence opened (the model writes a third
    copy), batched with the text prompts: NGRAM's greedy outputs equal no speculation's, and the
    copy's drafts are accepted."""
    tokenizer = Tokenizer.from_file(str(builtin_model / "tokenizer.json"))
    copy = tokenizer.encode(f"```python\n{CODE}```\n\n```python\n{CODE}```\n\n```python\n").ids
    expected = [ids for ids, _ in _run(_engine(builtin_model, None), [copy]).values()] + plain
    engine = _engine(builtin_model, None, speculative_algorithm=SpeculativeAlgorithm.NGRAM, speculative_num_steps=5)
    out = _run(engine, [copy, *prompts])
    assert [ids for ids, _ in out.values()] == expected
    assert out[0][1] >= MAX_NEW // 2, out  # the copy: most of its tokens came from accepted drafts
