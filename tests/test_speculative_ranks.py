"""Speculation at several ranks (docs/speculative.md, layouts): ``tierserve serve`` (real rank processes
over gloo) with NGRAM at TP 2, PP 2, CP 2 and TP 2 x CP 2, with a STANDALONE draft model at TP 2, PP 2 and CP 2
(its KV packed into the target's pools, or in a sidecar pool; at CP owned as the target's pages), at
TP 2 x CP 2 (sidecar) and PP 2 x CP 2 (packed), and with an EAGLE head at TP 2 (its rows in a sidecar), PP 2
(packed, on the last stage, which copies the target's embedding), TP 2 x PP 2 (sidecar, replicated on the
last stage's tensor ranks), CP 2 (packed) and TP 2 x CP 2 (sidecar, replicated on the tensor ranks), and with an
EAGLE-3 head at TP 2, PP 2 (the residual entering layer 0 captured on stage 0 and sent on with its output to
the last stage, which runs the head), CP 2 and TP 2 x CP 2, answers a
concurrent batch through the OpenAI API with the greedy tokens of no speculation and of
``transformers``, and with a single engine's accepted-draft counts per request (drafts accepted and
some rejected). With a draft model also: the batch again, its prefixes now cached with their draft
rows, gives the same counts, and so does a prompt followed by its answer (the answer's pages cached);
a seeded sampled request draws the single engine's tokens. At CP 2 a long prompt's split step gives the
single engine's answer and counts, with NGRAM and with a draft model whose own pass splits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import metrics
from helpers.engine_runs import spread_prompts
from helpers.rank_servers import NEW_TOKENS, TPServer, hf_greedy, start_server, token_ids
from helpers.tiny_models import (
    add_word_tokenizer,
    make_eagle_target,
    make_looping_model,
    make_mimic_eagle,
    make_mimic_eagle3,
    make_noisy_draft,
    widen_kv_heads,
)

from tierserve.cache.options import DraftLayout
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig, SpeculativeAlgorithm
from tierserve.engine.engine import Engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NGRAM = "ngram"
# HiCache with a 48-page L1 per rank (L2: 96): the batch (about 36 pages) fits, three more prompts push it to L2
L2 = ("--enable-hierarchical-cache", "--max-total-tokens", "192")
# per CP rank: 24 pages, 48 in all as L2's; so small that a logical page id read as a local slot is out of range
# (where a draft pass ignored CP: a 500)
CP_L2 = ("--enable-hierarchical-cache", "--max-total-tokens", "96")
# name: (tp size, more flags, draft source: a key of ``cases``), one server each; EAGLE's draft layout is
# ``auto`` (EAGLE-3's too): packed where the head's KV rows are shaped like a rank's target rows (PP 2), else sidecar
# the TP 2 x CP 2 and PP 2 x CP 2 drafts have CP_L2's HiCache, so their batch comes back from L1 and from L2;
# cp2 and cp2-standalone-packed: chunks of 512, so a long prompt's step splits (``test_a_split_step_under_...``;
# the batch's prompts take one chunk but equal the single engine's with chunks of 16)
LAYOUTS = {"tp2": (2, (), NGRAM), "pp2": (1, ("--pp-size", "2"), NGRAM),
           "cp2": (1, ("--cp-size", "2", "--chunked-prefill-size", "512"), NGRAM),
           "tp2-cp2": (2, ("--cp-size", "2"), NGRAM), "tp2-standalone-packed": (2, (), "packed"),
           "tp2-standalone-sidecar": (2, L2, "sidecar"), "pp2-standalone-packed": (1, ("--pp-size", "2"), "packed"),
           "pp2-standalone-sidecar": (1, ("--pp-size", "2"), "sidecar"), "tp2-eagle": (2, (), "eagle"),
           "pp2-eagle": (1, ("--pp-size", "2"), "eagle"), "tp2-pp2-eagle": (2, ("--pp-size", "2"), "eagle"),
           "cp2-standalone-packed": (1, ("--cp-size", "2", "--chunked-prefill-size", "512"), "packed"),
           "cp2-standalone-sidecar": (1, ("--cp-size", "2", *CP_L2), "sidecar"),
           "cp2-eagle": (1, ("--cp-size", "2", "--max-total-tokens", "96"), "eagle"),
           "tp2-cp2-standalone-sidecar": (2, ("--cp-size", "2", *CP_L2), "sidecar"),
           "tp2-cp2-eagle": (2, ("--cp-size", "2", *CP_L2), "eagle"),
           "pp2-cp2-standalone-packed": (1, ("--pp-size", "2", "--cp-size", "2", *CP_L2), "packed"),
           "tp2-eagle3": (2, (), "eagle3"), "pp2-eagle3": (1, ("--pp-size", "2"), "eagle3"),
           "cp2-eagle3": (1, ("--cp-size", "2", "--max-total-tokens", "96"), "eagle3"),
           "tp2-cp2-eagle3": (2, ("--cp-size", "2", *CP_L2), "eagle3")}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=7, ignore_eos=True)


def _engine(model: Path, ngram: bool) -> Engine:
    """A single engine with the servers' settings (``start_server``)."""
    spec = {"speculative_algorithm": SpeculativeAlgorithm.NGRAM} if ngram else {}
    return Engine(EngineConfig(model, dtype="float32", page_size=4, max_total_tokens=2048,
                               chunked_prefill_size=16, **spec))


def _single(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY
            ) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Each prompt's tokens and (draft, accepted) counts under ``params``, batched on one engine."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
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


@dataclass(frozen=True)
class Case:
    """A draft source's serving flags and what a single engine answers with it: the prompts' greedy
    tokens (no speculation's) and (draft, accepted) counts; with a draft model, the first prompt's
    seeded sampled tokens and counts too, and ``continued``: the first prompt followed by its answer,
    with its greedy tokens and counts."""

    model: Path
    flags: tuple[str, ...]
    prompts: list[list[int]]
    plain: list[list[int]]
    counts: list[tuple[int, int]]
    sampled: tuple[list[int], tuple[int, int]] | None = None
    continued: tuple[list[int], list[int], tuple[int, int]] | None = None
    engine: Callable[[], Engine] | None = None  # a single engine with the draft source


def _draft_case(model: Path, draft: Path, prompts: list[list[int]], plain: list[list[int]],
                **spec) -> Case:
    """A draft model's case (``spec``: more ``EngineConfig`` fields, e.g. the algorithm)."""
    def engine() -> Engine:
        return Engine(EngineConfig(model, dtype="float32", page_size=4, max_total_tokens=2048, chunked_prefill_size=16,
                                   speculative_draft_model_path=draft, **spec))

    outputs, counts = _single(engine(), prompts)
    assert outputs == plain
    assert 0 < sum(a for _, a in counts) < sum(d for d, _ in counts), counts  # accepted and rejected
    sampled, sampled_counts = _single(engine(), prompts[:1], SAMPLED)
    longer = prompts[0] + plain[0]
    more, more_counts = _single(engine(), [longer])
    algorithm = spec.get("speculative_algorithm", SpeculativeAlgorithm.STANDALONE).value
    layout = spec.get("speculative_draft_layout")
    flags = ("--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(draft),
             *(("--speculative-draft-layout", layout.value) if layout else ()))
    return Case(model, flags, prompts, plain, counts, (sampled[0], sampled_counts[0]),
                (longer, more[0], more_counts[0]), engine)


@pytest.fixture(scope="module")
def cases(reference, tmp_path_factory) -> dict[str, Case]:
    """Per draft source: NGRAM's; STANDALONE's packed and sidecar, with a draft model of the
    reference model (its weights plus noise: it agrees with the target part of the time; for the
    sidecar its KV heads widened, rows of another shape); EAGLE's, a head that recomputes a
    target's first layer with a tenth of the feature mixed in (its own target and answers; the
    target's second layer adds nothing, so it splits over two stages and the head still mimics it);
    EAGLE-3's, a head reading the residuals entering the target's layers 0, 1 and 2 (its own target,
    whose embedding is negligible, and answers), that recomputes the first layer with a tenth of the
    features mixed in, among them the embedding (layer 0's input, which a first stage takes): the
    same head blind to it accepts other counts, so a layout that lost that capture would too."""
    model, prompts, plain, counts = reference
    root = tmp_path_factory.mktemp("drafts")
    out = {NGRAM: Case(model, ("--speculative-algorithm", "NGRAM"), prompts, plain, counts,
                       engine=lambda: _engine(model, ngram=True))}
    for layout, draft in (("packed", make_noisy_draft(model, root / "noisy", 0.03)),
                          ("sidecar", widen_kv_heads(make_noisy_draft(model, root / "wide", 0.03)))):
        out[layout] = _draft_case(model, draft, prompts, plain, speculative_draft_layout=DraftLayout(layout))
    target = add_word_tokenizer(make_eagle_target(root / "eagle-target", layers=2))
    head = make_mimic_eagle(target, root / "eagle-head", 0.1)
    answers = _single(_engine(target, ngram=False), prompts)[0]
    assert answers == hf_greedy(target, prompts)
    out["eagle"] = _draft_case(target, head, prompts, answers, speculative_algorithm=SpeculativeAlgorithm.EAGLE)
    target3 = add_word_tokenizer(make_eagle_target(root / "eagle3-target", layers=2, embed_rms=0.01))
    head3 = make_mimic_eagle3(target3, root / "eagle3-head", 0.1, embed_feature=0.3)
    answers3 = _single(_engine(target3, ngram=False), prompts)[0]
    assert answers3 == hf_greedy(target3, prompts)
    out["eagle3"] = _draft_case(target3, head3, prompts, answers3, speculative_algorithm=SpeculativeAlgorithm.EAGLE)
    blind = _draft_case(target3, make_mimic_eagle3(target3, root / "eagle3-blind", 0.1), prompts, answers3,
                        speculative_algorithm=SpeculativeAlgorithm.EAGLE)
    assert blind.counts != out["eagle3"].counts
    return out


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request, cases, tmp_path_factory) -> Iterator[tuple[TPServer, Case, bool]]:
    """The layout's node, its case and whether it has HiCache (``L2``)."""
    tp, flags, source = LAYOUTS[request.param]
    case = cases[source]
    log = tmp_path_factory.mktemp(request.param) / "serve.log"
    node = start_server(case.model, tp, log, *case.flags, *flags).wait_healthy()
    yield node, case, "--enable-hierarchical-cache" in flags
    node.stop()


def _complete(node: TPServer, model: Path, prompt: list[int], params: SamplingParams = GREEDY
              ) -> tuple[str, tuple[int, int], dict[str, int]]:
    """The answer's text, its (draft, accepted) counts and its cached prompt tokens by tier."""
    reply = node.client().completions.create(model=model.name, prompt=prompt, max_tokens=params.max_tokens,
                                             temperature=params.temperature, seed=params.seed,
                                             extra_body={"ignore_eos": True})
    extra = reply.usage.model_extra or {}
    spec = extra.get("speculative") or {"draft_tokens": 0, "accepted_tokens": 0}
    return reply.choices[0].text, (spec["draft_tokens"], spec["accepted_tokens"]), extra["cached_tokens_by_tier"]


def _batch(node: TPServer, model: Path, prompts: list[list[int]]) -> list[tuple[str, tuple[int, int], dict]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(node, model, p), prompts))


def test_speculation_at_every_layout_equals_a_single_engine(server: tuple[TPServer, Case, bool]) -> None:
    """The batch, sent at once: every answer is no speculation's (and ``transformers``'), every
    request's draft and accepted counts the single engine's with the same draft source. With a
    draft model also: ``_cached_and_sampled``."""
    node, case, hicache = server
    answers = _batch(node, case.model, case.prompts)
    assert token_ids(case.model, [text for text, _, _ in answers]) == case.plain, node.log.read_text()[-3000:]
    assert [c for _, c, _ in answers] == case.counts
    if case.sampled is not None:
        _cached_and_sampled(node, case, hicache)


def _cached_and_sampled(node: TPServer, case: Case, hicache: bool) -> None:
    """The batch again, its prompts now cached (L1; with HiCache, then also L2 once three other
    prompts pushed them out of L1) with their draft rows (each rank's head share, or the last
    stage's) gives the single uncached engine's counts (a draft reading wrong rows would agree less
    or more); a seeded sampled request draws the single engine's tokens with its counts (every rank
    fed the sampling rank's draft draws). Between them, the first prompt followed by its answer
    matches the pages its answer filled (cached where every rank counted the same draft rows:
    a stage whose books differed would match another prefix) and gives the single engine's counts."""
    _again(node, case, "device")
    longer, tokens, counts = case.continued
    text, got, tiers = _complete(node, case.model, longer)
    assert tiers["device"] > len(case.prompts[0]), tiers
    assert (token_ids(case.model, [text])[0], got) == (tokens, counts)
    if hicache:
        for filler in spread_prompts(3, 40, seed=77):
            _complete(node, case.model, filler)
        _again(node, case, "host")
    text, got, _ = _complete(node, case.model, case.prompts[0], SAMPLED)
    sampled, counts = case.sampled
    assert token_ids(case.model, [text])[0] == [t for t in sampled if t >= 2]  # BOS and EOS do not come back as text
    assert got == counts


def _again(node: TPServer, case: Case, tier: str) -> None:
    """The batch, each prompt's prefix from ``tier``, answers and counts as the uncached engine's."""
    again = _batch(node, case.model, case.prompts)
    assert all(tiers[tier] > 0 for _, _, tiers in again), again
    assert token_ids(case.model, [text for text, _, _ in again]) == case.plain
    assert [c for _, c, _ in again] == case.counts


@pytest.mark.parametrize("server", ["cp2", "cp2-standalone-packed"], indirect=True)
def test_a_split_step_under_speculation_samples_its_own_rows(server: tuple[TPServer, Case, bool]) -> None:
    """At CP 2 with chunks of 512 a 300-token prompt's step splits its tokens between the ranks
    (docs/cp.md) though it runs as a speculative step (``Verify``, no drafts yet): the sampling rank
    samples the prompt's last row among its own rows (it indexed the flat rows, of which it holds
    about half: a 500), and the answer and counts are a single engine's. A draft model's pass over
    that prompt splits too (``tierserve_spec_draft_split_steps_total``), its KV as a whole pass's."""
    node, case, _ = server
    prompt = (case.prompts[0] * 12)[:300]
    tokens, counts = _single(case.engine(), [prompt])
    before = [_metric(node, name) for name in SPLITS]
    text, got, _ = _complete(node, case.model, prompt)
    assert (token_ids(case.model, [text])[0], got) == ([t for t in tokens[0] if t >= 2], counts[0])
    splits = [_metric(node, name) - b for name, b in zip(SPLITS, before, strict=True)]
    assert splits[0] > 0 and (splits[1] > 0) == (case.flags[1] == "STANDALONE"), splits


SPLITS = ("tierserve_cp_split_steps_total", "tierserve_spec_draft_split_steps_total")


def _metric(node: TPServer, name: str) -> float:
    found = metrics.find(metrics.scrape(node.url), name)
    assert found is not None, f"{name} not on /metrics"
    return found
