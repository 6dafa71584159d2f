"""NGRAM speculation at several ranks (docs/speculative.md, layouts): ``tierserve serve`` at PP 2, CP 2
and TP 2 x CP 2 (real rank processes over gloo) answers a concurrent batch through the OpenAI API with
the greedy tokens of no speculation and of ``transformers``, and with a single engine's accepted-draft
counts per request, drafts accepted on a prompt that repeats and some rejected. TP 2 alone is the
decode node of ``tests/test_speculative_pd.py``'s ``tierserve up`` test (one cluster fewer)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.engine_runs import spread_prompts
from helpers.rank_servers import NEW_TOKENS, TPServer, hf_greedy, start_server, token_ids
from helpers.tiny_models import add_word_tokenizer, make_looping_model

from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig, SpeculativeAlgorithm
from tierserve.engine.engine import Engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NGRAM = ("--speculative-algorithm", "NGRAM")
# name: (tp size, more flags), one server each
LAYOUTS = {"pp2": (1, ("--pp-size", "2")), "cp2": (1, ("--cp-size", "2")), "tp2-cp2": (2, ("--cp-size", "2"))}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def _engine(model: Path, ngram: bool) -> Engine:
    """A single engine with the servers' settings (``start_server``)."""
    spec = {"speculative_algorithm": SpeculativeAlgorithm.NGRAM} if ngram else {}
    return Engine(EngineConfig(model, dtype="float32", page_size=4, max_total_tokens=2048,
                               chunked_prefill_size=16, **spec))


def _single(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Each prompt's greedy tokens and (draft, accepted) counts, batched on one engine."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    counts: dict[str, tuple[int, int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            counts[out.request_id] = (out.spec_draft_tokens, out.spec_accepted_tokens)
    return [tokens[str(i)] for i in range(len(prompts))], [counts[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]], list[tuple]]:
    """The tiny llama with attention scaled down (runs of tokens recur, not always alike: drafts
    are accepted and rejected), its prompts (one ending in text it repeats, two random ones over
    several prefill chunks), their greedy answers and a single NGRAM engine's counts."""
    model = make_looping_model(tiny_llama, tmp_path_factory.mktemp("wandering") / "model", 0.02)
    add_word_tokenizer(model)
    seed, others = spread_prompts(1, 10, seed=3)[0], spread_prompts(2, 13, seed=21)
    text = _single(_engine(model, ngram=False), [seed])[0][0]
    prompts = [seed + text, *[p * 2 for p in others]]  # 26, 26 and 32 tokens: two chunks each
    plain, _ = _single(_engine(model, ngram=False), prompts)
    assert plain == hf_greedy(model, prompts)
    assert all(t >= 2 for out in plain for t in out)  # BOS and EOS would not come back as text
    outputs, counts = _single(_engine(model, ngram=True), prompts)
    assert outputs == plain
    assert 0 < counts[0][1] < counts[0][0], counts  # accepted and rejected drafts on the repeating prompt
    return model, prompts, plain, counts


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request, reference, tmp_path_factory) -> Iterator[TPServer]:
    tp, flags = LAYOUTS[request.param]
    log = tmp_path_factory.mktemp(request.param) / "serve.log"
    node = start_server(reference[0], tp, log, *NGRAM, *flags).wait_healthy()
    yield node
    node.stop()


def _complete(node: TPServer, model: Path, prompt: list[int]) -> tuple[str, tuple[int, int]]:
    reply = node.client().completions.create(model=model.name, prompt=prompt, max_tokens=NEW_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True})
    spec = (reply.usage.model_extra or {}).get("speculative") or {"draft_tokens": 0, "accepted_tokens": 0}
    return reply.choices[0].text, (spec["draft_tokens"], spec["accepted_tokens"])


def test_ngram_at_every_layout_equals_a_single_engine(reference, server: TPServer) -> None:
    """The batch, sent at once: every answer is no speculation's (and ``transformers``'), every
    request's draft and accepted counts the single engine's."""
    model, prompts, plain, counts = reference
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: _complete(server, model, p), prompts))
    assert token_ids(model, [text for text, _ in answers]) == plain, server.log.read_text()[-3000:]
    assert [c for _, c in answers] == counts
