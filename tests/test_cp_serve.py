"""``tierserve serve --cp-size 2`` (two rank processes over gloo, each storing half of the KV pages
and gathering the cached prefix from the other) answers greedy requests through the OpenAI API
exactly as ``transformers`` does: a batch of concurrent prompts over several prefill chunks,
prompts that extend a cached prefix (its rotation continued, so each turn hits the whole previous
one), and a prompt sharing a prefix another one computed while it runs (in-flight sharing: the
rotation continued, nothing refused). Composed
with TP and PP (TP 2 x CP 2 on Qwen2, PP 2 x CP 2 on Qwen3: four ranks each, one server start per
layout) the batch and the turns answer the same."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from helpers import metrics
from helpers.polling import poll_settled
from helpers.rank_servers import (
    HEADS,
    NEW_TOKENS,
    TPServer,
    complete_all,
    hf_greedy,
    prompts,
    start_server,
    token_ids,
)
from helpers.tiny_models import add_word_tokenizer, make_tiny_model

from tierserve.engine.commands import AHEAD_PROMPT_TOKENS

pytestmark = pytest.mark.integration
PAGE = 4  # tp_server's page size
DEADLINE_S = 30.0
# CP 2 composed: (family, TP size, other flags, layers); PP stages get two layers each, so each
# stage's layer 0 merges and its layer 1 gathers (docs/cp.md). Each layout runs another family than
# Llama (whose composed layouts run in test_cp_pd.py, test_rank_hicache.py and test_up_ranks.py):
# Qwen2's biases with TP's head split, Qwen3's q/k norms with PP's stages, one server start each.
COMPOSED = {"tp2cp2": ("qwen2", 2, [], 2), "pp2cp2": ("qwen3", 1, ["--pp-size", "2"], 4)}


def _model(family: str, folder: Path, layers: int = 2) -> Path:
    heads, kv_heads = HEADS[family]
    model = make_tiny_model(family, folder, heads=heads, kv_heads=kv_heads, layers=layers)
    return add_word_tokenizer(model)


def _serve(model: Path, log: Path, attention: str = "merge") -> TPServer:
    return start_server(model, 1, log, "--cp-size", "2", "--cp-attention", attention).wait_healthy()


def _cached(client: openai.OpenAI, model: Path, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy output ids and the prompt tokens served from the cache."""
    reply = client.completions.create(model=model.name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    return token_ids(model, [reply.choices[0].text])[0], reply.usage.prompt_tokens_details.cached_tokens


def _refused_pages(server: TPServer) -> float:
    return metrics.value(metrics.scrape(server.url), "tierserve_cache_cp_refused_pages_total")


def _gather_clock(server: TPServer) -> dict[str, float]:
    """The per-layer gather clock's counters on ``/metrics`` (rank 0), by ``{first,later}_{wait,span}``."""
    return metrics.by_suffix(metrics.scrape(server.url), "tierserve_cp_gather_", "_seconds_total")


def _merges(server: TPServer) -> dict[str, float]:
    """Steps whose every layer merged (``short``) or layer 0 only (``first_layer``), on ``/metrics``."""
    return metrics.by_suffix(metrics.scrape(server.url), "tierserve_cp_merge_", "_steps_total")


def _wait_gathered(server: TPServer) -> dict[str, float]:
    """The gather clock once it counted a later layer's gather (stats lag a step)."""
    return poll_settled(lambda: _gather_clock(server), lambda clock: clock.get("later_span", 0) != 0, DEADLINE_S)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return _model("llama", tmp_path_factory.mktemp("llama") / "llama")


@pytest.fixture(scope="module", params=["merge", "gather"])
def llama_server(request, llama: Path, tmp_path_factory) -> Iterator[tuple[str, TPServer]]:
    """A healthy ``serve --cp-size 2`` of ``llama`` per ``--cp-attention``, shared by the tests of
    that attention (each start spends seconds; they all read it, nothing breaks it)."""
    server = _serve(llama, tmp_path_factory.mktemp(f"cp-{request.param}") / "serve.log", request.param)
    yield request.param, server
    server.stop()


@pytest.mark.parametrize("family", [pytest.param("qwen2", marks=pytest.mark.slow),
                                    pytest.param("qwen3", marks=pytest.mark.slow)])
def test_a_batch_with_chunked_prefill_equals_transformers(family: str, tmp_path: Path) -> None:
    """Other families than Llama (``test_llama_batch_then_turns_answer_as_transformers``), merged attention."""
    model = _model(family, tmp_path / family)
    server = _serve(model, tmp_path / "serve.log")
    try:
        _check_batch(model, server)
    finally:
        server.stop()


def _check_batch(model: Path, server: TPServer) -> None:
    """Four concurrent prompts of up to 70 tokens (five 16-token prefill chunks) answer as ``transformers``."""
    asked = prompts()
    expected = hf_greedy(model, asked)
    texts = complete_all(server, model, asked)
    assert token_ids(model, texts) == expected, server.log.read_text()[-3000:]


def test_llama_batch_then_turns_answer_as_transformers(llama: Path, llama_server: tuple[str, TPServer]) -> None:
    """The batch (``_check_batch``), then turns on the same server (one per attention): each turn is
    the previous prompt, its answer and new words, so its pages continue the previous turn's
    rotation, the tree keeps them and the next turn hits every full page of it. With ``merge``,
    decodes merge every layer and chunks after a hit merge layer 0 (no layer 0 gather is left); with
    ``gather``, every layer of every step gathers (the seed's protocol alone)."""
    attention, server = llama_server
    _check_batch(llama, server)
    _check_turns(llama, server, attention)


def _check_turns(model: Path, server: TPServer, attention: str) -> None:
    """Three turns, each extending the last: every answer is ``transformers``', every turn hits
    the whole previous one, nothing is refused, and rank 0's clocks show where it merged or gathered."""
    gen = torch.Generator().manual_seed(5)
    client = server.client()
    prompt, previous = torch.randint(2, 384, (30,), generator=gen).tolist(), 0
    for turn in range(3):
        out, cached = _cached(client, model, prompt)
        assert out == hf_greedy(model, [prompt])[0], f"turn {turn}"
        if previous:
            assert cached == previous // PAGE * PAGE, f"turn {turn}: {cached} of {previous} cached"
        previous = len(prompt) + NEW_TOKENS - 1  # the last answer token's KV is never computed
        prompt = prompt + out + torch.randint(2, 384, (9,), generator=gen).tolist()
    assert _refused_pages(server) == 0
    clock = _wait_gathered(server)  # hits gather their prefix: the exposed share is measured
    assert 0 <= clock["later_wait"] <= clock["later_span"] and clock["later_span"] > 0, clock
    merges = _merges(server)
    if attention == "merge":
        assert clock["first_span"] == 0, clock
        assert merges["short"] >= 3 * (NEW_TOKENS - 1) and merges["first_layer"] >= 2, merges
    else:
        assert 0 <= clock["first_wait"] <= clock["first_span"] and clock["first_span"] > 0, clock
        assert merges == {"short": 0, "first_layer": 0}, merges


@pytest.fixture(scope="module", params=list(COMPOSED))
def composed(request, tmp_path_factory) -> Iterator[tuple[Path, TPServer]]:
    """A tiny model (``COMPOSED``'s family) and a healthy ``serve --cp-size 2`` composed with TP or
    PP (four ranks)."""
    family, tp, flags, layers = COMPOSED[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = _model(family, folder / family, layers)
    server = start_server(model, tp, folder / "serve.log", "--cp-size", "2", *flags).wait_healthy()
    yield model, server
    server.stop()


def test_cp_composed_with_tp_or_pp_answers_batches_and_turns_as_transformers(composed) -> None:
    """One start per layout: the concurrent batch over several chunks, then the turns (L1 hits of
    the whole previous turn, merged decodes, gathered later layers), all ``transformers``' answers."""
    model, server = composed
    _check_batch(model, server)
    _check_turns(model, server, "merge")


@pytest.mark.parametrize("llama_server", ["merge"], indirect=True)
def test_a_prefix_shared_in_flight_continues_its_rotation(llama: Path, llama_server: tuple[str, TPServer]) -> None:
    """A and B share a 24-token prefix and B arrives while A still runs: A's prompt pages joined the
    tree as A computed them (in-flight sharing, docs/cache.md), so B hits the prefix and its own pages
    continue that rotation: none refused, and C, which extends B's prompt, hits all of it. Every
    answer equals transformers. (Pages of another rotation are refused: tests/test_cp_pages.py.)"""
    model, (_, server) = llama, llama_server
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(2, 384, (24,), generator=gen).tolist()
    a = [*prefix, 11, *torch.randint(2, 384, (11,), generator=gen).tolist()]
    b = [*prefix, 12, *torch.randint(2, 384, (11,), generator=gen).tolist()]
    c = b + torch.randint(2, 384, (8,), generator=gen).tolist()
    expected = hf_greedy(model, [a, b, c])
    client = server.client()
    stream = client.completions.create(model=model.name, prompt=a, max_tokens=NEW_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))  # A's prompt is computed (and shared) before B arrives
    with ThreadPoolExecutor(1) as pool:
        b_reply = pool.submit(_cached, client, model, b)
        a_text = first.choices[0].text + "".join(chunk.choices[0].text for chunk in stream)
        b_out, b_cached = b_reply.result()
    assert token_ids(model, [a_text]) == expected[:1]
    assert b_out == expected[1] and b_cached == len(prefix)
    c_out, c_cached = _cached(client, model, c)
    assert c_out == expected[2]
    assert c_cached == len(b)  # B's own pages continued the prefix's rotation: all stored
    assert _refused_pages(server) == 0


def test_long_prompts_published_ahead_of_rank_0_keep_the_ranks_in_step(tmp_path: Path) -> None:
    """A prompt of ``AHEAD_PROMPT_TOKENS`` or more goes to the other rank before rank 0 applies it
    (docs/ranks.md, step bus): one that fits answers as transformers; one the pool cannot hold is
    refused on both ranks, rank 0's outcome arriving with the next message, so the node stays up and
    answers the next request as transformers too."""
    heads, kv_heads = HEADS["llama"]
    model = add_word_tokenizer(make_tiny_model("llama", tmp_path / "llama", max_position=4 * AHEAD_PROMPT_TOKENS,
                                               heads=heads, kv_heads=kv_heads))
    per_rank = AHEAD_PROMPT_TOKENS  # the node holds twice that
    server = start_server(model, 1, tmp_path / "serve.log", "--cp-size", "2", "--max-total-tokens", str(per_rank),
                          "--chunked-prefill-size", "1024").wait_healthy()
    gen = torch.Generator().manual_seed(9)
    fits = torch.randint(2, 384, (AHEAD_PROMPT_TOKENS + 100,), generator=gen).tolist()
    too_long = torch.randint(2, 384, (2 * per_rank + 1,), generator=gen).tolist()
    after = torch.randint(2, 384, (30,), generator=gen).tolist()
    try:
        client = server.client()
        assert _cached(client, model, fits)[0] == hf_greedy(model, [fits])[0]
        with pytest.raises(openai.BadRequestError, match="KV cache"):
            _cached(client, model, too_long)
        assert _cached(client, model, after)[0] == hf_greedy(model, [after])[0], server.log.read_text()[-3000:]
    finally:
        server.stop()
