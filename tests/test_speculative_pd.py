"""Speculative decoding through prefill-decode disaggregation: the prefill node computes the
draft's KV for the prompt and hands it over with the target's (a packed draft: its layers are
more layers of every page; a sidecar draft, whose KV heads differ: its own pool into the decode
node's draft pool, from the same page indexes), so the decode node speculates from its first step
with the draft state a single engine would have. Checked by effect: per request, greedy output
equals decoding without speculation and the accepted-draft count equals a single uncached engine's,
on a cold and on a warm cluster (prefixes cached on both nodes), through gRPC as the router drives
the nodes and through ``tierserve up``; noise written over the handed draft rows changes the counts.
An EAGLE head's rows and the target's hidden states it reads travel the same way (sidecar or packed);
an EAGLE-3 head's rows and the three residual streams it reads too (its feature plane three times as
wide; through ``up`` from a prefill node of two pipeline stages, whose first takes one of them, into a
decode node of two tensor ranks, from CP 2 into TP 2 x CP 2, and on one rank on both nodes)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import torch
import transformers
from helpers import metrics
from helpers.eagle_drafts import recorded_drafts
from helpers.logprob_checks import ids_of
from helpers.pd_nodes import CHUNK, DECODE_ARGS, MAX_NEW, NODE_ARGS, PAGE, greedy, node_metric, reference
from helpers.processes import NodeProcess, free_port, running_up
from helpers.tiny_models import (
    WORD_REGEX,
    add_word_tokenizer,
    make_eagle_target,
    make_looping_model,
    make_mimic_eagle,
    make_mimic_eagle3,
    make_noisy_draft,
    make_tiny_model,
    widen_kv_heads,
)

from tierserve.cache.options import DraftLayout
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.core.constraint import Constraint, ConstraintKind
from tierserve.core.model_config import ModelConfig
from tierserve.core.outputs import TokenLogprob
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig, SpeculativeAlgorithm
from tierserve.engine.engine import Engine
from tierserve.engine.handoff import HandoffCheckError
from tierserve.engine.request import Request
from tierserve.node.convert import destination_ranks, kv_ranks, sidecar_problem
from tierserve.node.rank_transfer import HandoffPlan, NodeRankRole, RankTransfer, Side, TransferOptions
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto.sampling import logprob_from_proto, to_proto
from tierserve.router import pd_flow
from tierserve.transfer.handoff import HandoffResult
from tierserve.transfer.receive_check import ReceiveCheck

pytestmark = pytest.mark.integration
WORD_REGEX_IDS = {*range(2, 10), *range(20, 100)}  # the words WORD_REGEX allows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny llama with a word tokenizer (the API answers in text too; grammars can read it)."""
    return add_word_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("llama")), byte_level=True)


@pytest.fixture(scope="module")
def drafts(tiny: Path, tmp_path_factory) -> dict[str, Path]:
    """A draft agreeing with the tiny llama about half the time, in each layout: KV rows shaped
    like the target's (packed) or, the same model with twice the KV heads, not (sidecar)."""
    root = tmp_path_factory.mktemp("draft")
    wide = widen_kv_heads(make_noisy_draft(tiny, root / "wide", 0.03))
    return {"packed": make_noisy_draft(tiny, root / "noisy", 0.03), "sidecar": wide}


def _prompts() -> list[list[int]]:
    """Prompts of one to several prefill chunks, some sharing a prefix."""
    base = [(7 * i) % 380 + 2 for i in range(150)]
    return [base[:40], base[:150], [*base[:70], 9, 8, 7, 6, 5], [(3 * i) % 380 + 2 for i in range(23)]]


def _engine(model: Path, draft: Path, cache: bool = True, **spec) -> Engine:
    """``spec``: more speculative settings (EAGLE's algorithm and layout)."""
    return Engine(EngineConfig(model, dtype="float32", page_size=PAGE, chunked_prefill_size=CHUNK,
                               max_total_tokens=4096, disable_radix_cache=not cache,
                               speculative_draft_model_path=draft, **spec))


def _uncached(model: Path, draft: Path, prompts: list[list[int]], **spec) -> dict[int, tuple[list[int], int]]:
    """Each prompt's (output, accepted drafts) on one engine without a prefix cache, batched."""
    engine = _engine(model, draft, cache=False, **spec)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    return _drain(engine)


def _drain(engine: Engine) -> dict[int, tuple[list[int], int]]:
    """Steps ``engine`` until idle: each request's (output, accepted drafts), by its numeric id."""
    out: dict[int, tuple[list[int], int]] = {}
    while engine.has_work():
        for o in engine.step():
            ids, _ = out.get(int(o.request_id), ([], 0))
            out[int(o.request_id)] = (ids + o.new_token_ids, o.spec_accepted_tokens)
    return dict(sorted(out.items()))


async def _run_pd(prefill: str, decode: str, rid: str, prompt: list[int]) -> tuple[list[int], int, int]:
    """As the router: Reserve, Prefill, Generate; (output, accepted drafts, prompt tokens D cached)."""
    async with grpc.aio.insecure_channel(prefill) as p, grpc.aio.insecure_channel(decode) as d:
        pair = pd_flow.Pair.connect(p, d)
        done = await pd_flow.prefill(pair, rid, prompt, greedy(), timeout_s=60)
        tokens, accepted = [], 0  # the first chunk carries P's first token
        async for chunk in pd_flow.generate(pair, done, greedy()):
            tokens, accepted = tokens + list(chunk.token_ids), chunk.spec_accepted_tokens
        return tokens, accepted, done.response.cache.cached_tokens


@pytest.fixture(scope="module", params=["packed", "sidecar"])
def spec_pair(request, tiny: Path, drafts: dict[str, Path], tmp_path_factory
              ) -> Iterator[tuple[NodeProcess, NodeProcess, Path]]:
    """A prefill and a decode node with the draft of one layout (``auto`` picks it), both with
    ``--handoff-integrity`` (so every test here also finds no false alarm over the draft's layers)."""
    logs, draft = tmp_path_factory.mktemp(f"spec-pd-{request.param}"), drafts[request.param]
    flags = ["--model", str(tiny), "--speculative-draft-model-path", str(draft), "--speculative-num-steps", "3",
             "--handoff-integrity"]
    prefill = NodeProcess("prefill", [*flags, *NODE_ARGS], logs / "prefill.log")
    decode = NodeProcess("decode", [*flags, *DECODE_ARGS, "--metrics-port", str(free_port())], logs / "decode.log")
    try:
        yield prefill.wait_ready(), decode.wait_ready(), draft
    finally:
        prefill.stop()
        decode.stop()


def test_pd_handoff_carries_the_draft_state(tiny: Path, spec_pair) -> None:
    prefill, decode, draft = spec_pair
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
    assert node_metric(decode, "tierserve_spec_prompt_catch_up_tokens_total") == 0
    assert node_metric(decode, "tierserve_spec_draft_tokens_total") > 0


def test_pd_digests_cover_the_draft_layers(tiny: Path, spec_pair) -> None:
    """The prefill node's digests have one value per target layer, then one per draft layer (packed:
    more layers of its pool; sidecar: its draft pool's), and the decode node checks those too: a
    Generate whose digest of the draft's last layer is one off is refused, a counted DATA_LOSS."""
    prefill, decode, draft = spec_pair
    layers = ModelConfig.from_dir(tiny).num_layers, ModelConfig.from_dir(draft).num_layers
    before = node_metric(decode, "tierserve_handoff_integrity_failures_total")
    count, error = asyncio.run(_with_a_wrong_draft_digest(prefill.address, decode.address, _prompts()[1]))
    assert count == sum(layers)
    assert error.code() is grpc.StatusCode.DATA_LOSS and f"layers [{sum(layers) - 1}]" in error.details()
    assert node_metric(decode, "tierserve_handoff_integrity_failures_total") == before + 1


async def _with_a_wrong_draft_digest(prefill: str, decode: str, prompt: list[int]) -> tuple[int, grpc.aio.AioRpcError]:
    """As the router, with the last layer's digest (the draft's) changed before Generate: how many
    digests the prefill node sent, and the decode node's answer."""
    async with grpc.aio.insecure_channel(prefill) as p, grpc.aio.insecure_channel(decode) as d:
        pair = pd_flow.Pair.connect(p, d)
        done = await pd_flow.prefill(pair, "tampered", prompt, greedy(), timeout_s=60)
        digests = done.response.kv_digests
        digests[-1] ^= 1
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in pd_flow.generate(pair, done, greedy()):
                pass
        return len(digests), refused.value


def test_pd_speculation_under_a_grammar_equals_one_engine(tiny: Path, spec_pair) -> None:
    """A regex-constrained greedy request through the pair (docs/structured.md): P samples the first
    token under the grammar, D verifies the unconstrained drafts under its mask, so forbidden drafts
    are refused; output, accepted drafts and masked logprobs (allowed tokens only) equal one
    speculating engine's, and the output the plain engine's."""
    prefill, decode, draft = spec_pair
    params = SamplingParams(max_tokens=2 * MAX_NEW, temperature=0, ignore_eos=True, logprobs=3,
                            constraint=Constraint(ConstraintKind.REGEX, WORD_REGEX))
    prompt = _prompts()[2]
    got = asyncio.run(_run_constrained(prefill.address, decode.address, prompt, to_proto(params)))
    plain = Engine(EngineConfig(tiny, dtype="float32", page_size=PAGE, max_total_tokens=4096)).generate([prompt],
                                                                                                        params)
    spec = _engine(tiny, draft, cache=False)
    spec.add_request("0", prompt, params)
    outs = [o for _ in range(4 * MAX_NEW) if spec.has_work() for o in spec.step()]
    want = [lp for o in outs for lp in o.logprobs or []]
    assert got.tokens == plain[0] == [lp.token_id for lp in want]
    assert got.accepted == outs[-1].spec_accepted_tokens and got.drafted > got.accepted  # some drafts refused
    assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want], abs=1e-4)
    assert all(t in WORD_REGEX_IDS for lp in got.logprobs for t, _ in lp.top)


@dataclasses.dataclass
class _Run:
    tokens: list[int]
    accepted: int
    drafted: int
    logprobs: list[TokenLogprob]


async def _run_constrained(prefill: str, decode: str, prompt: list[int], sampling: pb.SamplingOptions) -> _Run:
    """As the router, with ``sampling``: the output, its drafts and the logprobs (P's first, then D's)."""
    async with grpc.aio.insecure_channel(prefill) as p, grpc.aio.insecure_channel(decode) as d:
        pair = pd_flow.Pair.connect(p, d)
        done = await pd_flow.prefill(pair, "constrained", prompt, sampling, timeout_s=60)
        run = _Run([], 0, 0, [logprob_from_proto(done.response.first_logprob)])
        async for chunk in pd_flow.generate(pair, done, sampling):
            run.tokens += chunk.token_ids
            run.logprobs += [logprob_from_proto(lp) for lp in chunk.logprobs]
            run.accepted, run.drafted = chunk.spec_accepted_tokens, chunk.spec_draft_tokens
        return run


@pytest.mark.slow
# each role's sizes: TP 2 on both sides (packed: the draft's layers of each rank's heads; EAGLE: the replicated
# head's rows from prefill rank 0 into both decode ranks), the split sidecar draft's heads from the last
# of two stages into two tensor ranks, and the packed draft's layers from two tensor ranks (through the
# decode ranks' staging) into the last of two stages (rank 0 of which holds none of them); with CP (the draft's
# pages owned as the target's): the packed draft's layers and the EAGLE head's sidecar rows (its feature plane
# with them) each sent by their page's prefill owner into a TP2xCP2 decode node (the owner's local slots of each
# head shard), the sidecar's rows each into its decode owner's local slots;
# EAGLE's ``auto`` from two stages into two stages: packed on both nodes (the head's layers on each last stage only;
# into two tensor ranks ``up`` makes it the sidecar on both, ``test_up_plan``, passed here once by hand); and
# one rank on both nodes (the sidecar draft, the EAGLE head); an EAGLE-3 head's ``auto`` from two stages (the first
# capturing the embedding, which the head reads, and sending it on) into two tensor ranks: the sidecar on both;
# and the EAGLE-3 head (sidecar) from CP 2 into TP 2 x CP 2, and on one rank on both nodes
@pytest.mark.parametrize(("layout", "sizes"), [("packed", "--prefill-tp-size 2 --decode-tp-size 2"),
                                               ("sidecar", "--prefill-pp-size 2 --decode-tp-size 2"),
                                               ("eagle", "--prefill-tp-size 2 --decode-tp-size 2"),
                                               ("packed", "--prefill-tp-size 2 --decode-pp-size 2"),
                                               ("packed", "--prefill-cp-size 2 --decode-tp-size 2 --decode-cp-size 2"),
                                               ("sidecar", "--decode-cp-size 2"),
                                               ("eagle", "--prefill-cp-size 2 --decode-tp-size 2 --decode-cp-size 2"),
                                               ("eagle-auto", "--prefill-pp-size 2 --decode-pp-size 2"),
                                               ("sidecar", ""), ("eagle", ""),
                                               ("eagle3-auto", "--prefill-pp-size 2 --decode-tp-size 2"),
                                               ("eagle3", "--prefill-cp-size 2 --decode-tp-size 2 --decode-cp-size 2"),
                                               ("eagle3", "")],
                         ids=["packed-tp2-tp2", "sidecar-pp2-tp2", "eagle-tp2-tp2", "packed-tp2-pp2",
                              "packed-cp2-tp2cp2", "sidecar-1-cp2", "eagle-cp2-tp2cp2", "eagle-packed-pp2-pp2",
                              "sidecar-1-1", "eagle-1-1", "eagle3-pp2-tp2", "eagle3-cp2-tp2cp2", "eagle3-1-1"])
def test_up_with_a_draft_equals_no_speculation(request, tiny: Path, drafts: dict[str, Path], layout: str,
                                               sizes: str) -> None:
    """``tierserve up`` (router, prefill node, decode node, of several ranks) with a draft of either
    layout, or an EAGLE-1 or EAGLE-3 head (its hidden states, or captures, handed over with its
    rows): greedy outputs equal decoding without speculation, ``usage.speculative`` the single
    engine's counts, and the decode node's draft computes no prompt position (every decode rank
    holding the draft got its rows).
    With ``--handoff-integrity``: the ranks' digests of the draft's rows add up on both sides (the
    replicated EAGLE head's, sent by prefill rank 0 to both decode ranks, counted once per decode rank)."""
    batch, model, draft = _prompts(), tiny, drafts.get(layout)
    spec, flags = {}, []
    if layout.startswith("eagle"):
        heads = request.getfixturevalue(layout.split("-")[0])  # ``eagle`` or ``eagle3``
        model, draft, spec = heads["target"], heads["head"], _EAGLE
        sidecar = not layout.endswith("-auto")
        flags = ["--speculative-algorithm", "EAGLE", *(["--speculative-draft-layout", "sidecar"] * sidecar)]
    plain, want = reference(model, batch), _uncached(model, draft, batch, **spec)
    words = transformers.AutoTokenizer.from_pretrained(model)  # one word per token id
    port = free_port()
    with running_up(port, "--model", str(model), "--dtype", "float32", "--no-l3", "--page-size", str(PAGE),
                    "--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "4096",
                    *sizes.split(), "--handoff-integrity",  # the draft's digests add up across ranks: no false alarm
                    "--speculative-draft-model-path", str(draft), *flags) as lines:
        # concurrent: the nodes batch them; no logprobs (none at pipeline stages yet): the text says the tokens
        answers = asyncio.run(_complete_all(port, batch, logprobs=False))
        assert all("choices" in a for a in answers), answers
        assert [a["choices"][0]["text"] for a in answers] == [words.decode(ids) for ids in plain]
        assert [a["usage"]["speculative"]["accepted_tokens"] for a in answers] == [n for _, n in want.values()]
        assert sum(n for _, n in want.values()) > 0
        decode = _metrics_of(lines, "decode-0")
        assert metrics.find(decode, "tierserve_spec_prompt_catch_up_tokens_total") == 0
        assert metrics.find(decode, "tierserve_spec_accepted_tokens_total") == sum(n for _, n in want.values())
        assert metrics.find(decode, "tierserve_handoff_integrity_failures_total") == 0  # no retried false alarm


def _metrics_of(lines: list[str], child: str) -> str:
    """The /metrics text of ``up``'s ``child``, at the URL its banner line names."""
    line = next(x for x in "".join(lines).splitlines() if x.strip().startswith(child + " "))
    url = next(f.removeprefix("metrics=") for f in line.split() if f.startswith("metrics="))
    return metrics.scrape(url.removesuffix("/metrics"))


@pytest.mark.slow
@pytest.mark.parametrize("sizes", ["", "--decode-tp-size 2", "--decode-cp-size 2", "--decode-pp-size 2",
                                   "--decode-tp-size 2 --decode-cp-size 2"], ids=["1", "tp2", "cp2", "pp2", "tp2cp2"])
def test_up_with_ngram_equals_no_speculation(tiny: Path, tmp_path: Path, sizes: str) -> None:
    """``tierserve up --speculative-algorithm NGRAM`` (no draft model; the decode node, of one rank or
    several, looks up the prompt it was handed and its output): greedy outputs equal decoding
    without speculation and ``usage.speculative`` a single engine's counts, drafts accepted on
    prompts that repeat."""
    model = add_word_tokenizer(make_looping_model(tiny, tmp_path / "looping"), byte_level=True)
    seeds = [[(5 * i + k) % 380 + 2 for i in range(10)] for k in range(4)]
    continued = reference(model, seeds)  # the model's cycles: prompts whose text repeats
    batch = [seed + text + reference(model, [seed + text])[0] for seed, text in zip(seeds, continued, strict=True)]
    plain = reference(model, batch)
    single = Engine(EngineConfig(model, dtype="float32", page_size=PAGE, chunked_prefill_size=CHUNK,
                                 max_total_tokens=4096, speculative_algorithm=SpeculativeAlgorithm.NGRAM))
    for i, prompt in enumerate(batch):
        single.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    want = [n for _, n in _drain(single).values()]
    assert sum(want) > 0
    port = free_port()
    with running_up(port, "--model", str(model), "--dtype", "float32", "--no-l3", "--page-size", str(PAGE),
                    "--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "4096",
                    "--speculative-algorithm", "NGRAM", *sizes.split()):
        pp = "pp" in sizes  # no logprobs at pipeline stages yet: the text says the tokens
        answers = asyncio.run(_complete_all(port, batch, logprobs=not pp))
        assert all("choices" in a for a in answers), answers
        if pp:
            words = transformers.AutoTokenizer.from_pretrained(model)
            assert [a["choices"][0]["text"] for a in answers] == [words.decode(ids) for ids in plain]
        else:
            assert [ids_of(a["choices"][0]["logprobs"]["tokens"]) for a in answers] == plain
        assert [a["usage"]["speculative"]["accepted_tokens"] for a in answers] == want


async def _complete_all(port: int, batch: list[list[int]], logprobs: bool = True) -> list[dict]:
    """``batch``'s greedy completions, at once; ``logprobs``: with the tokens' ids in their logprobs."""
    ids = {"return_tokens_as_token_ids": True, "logprobs": 0} if logprobs else {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        bodies = [{"prompt": p, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, **ids} for p in batch]
        answers = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        return [a.json() for a in answers]


@pytest.fixture(scope="module")
def sides(tiny: Path, drafts: dict[str, Path]) -> tuple[RankTransfer, RankTransfer]:
    """A prefill and a decode engine with the sidecar draft, each with its node's transfer side
    (transfer engines, registered pools) in this process, so the test can reach the decode pools.
    D caches nothing, so every prompt token is handed over; P's cache serves the second round."""
    prefill, decode = _engine(tiny, drafts["sidecar"]), _engine(tiny, drafts["sidecar"], cache=False)
    return NodeRankRole(Side.PREFILL, TransferOptions()).start(prefill), \
        NodeRankRole(Side.DECODE, TransferOptions()).start(decode)


def _handed_over(sides: tuple[RankTransfer, RankTransfer], batch: list[list[int]], noise: bool,
                 layers: slice = slice(None)) -> dict[int, tuple[list[int], int]]:
    """Each prompt reserved on D, computed and handed over (with the sidecar draft's pool) by P,
    then decoded on D, batched; ``noise``: the handed draft rows (of ``layers``) are overwritten
    before D decodes."""
    reserved, first, _ = _hand(sides, batch)
    if noise:
        slots = torch.tensor([page * PAGE + j for r in reserved for page in r.pages for j in range(PAGE)])
        rows = sides[1].engine.draft_pool.buffer
        rows[layers, :, slots] = torch.randn(rows[layers, :, slots].shape) * 4
    return _decoded(sides[1].engine, first)  # type: ignore[return-value]


def _hand(sides: tuple[RankTransfer, RankTransfer], batch: list[list[int]]
          ) -> tuple[list[Request], dict[int, tuple[list[int], int]], list[HandoffResult]]:
    """Each prompt reserved on D, computed and handed over by P (its sidecar draft's pool too):
    D's reservations, P's first tokens, the handoffs' results (each succeeded)."""
    p, d = sides
    reserved = [d.engine.reserve(str(i), prompt, MAX_NEW) for i, prompt in enumerate(batch)]
    handoffs = [p.handoff(HandoffPlan((d.arenas[0],), tuple(r.pages), r.num_computed, len(r.prompt_ids)))
                for r in reserved]
    for i, (prompt, handoff) in enumerate(zip(batch, handoffs, strict=True)):
        p.engine.add_request(str(i), prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                             handoff=handoff)
    first = _drain(p.engine)
    results = [h.result(30) for h in handoffs]
    assert [r.error for r in results] == [None] * len(batch)
    return reserved, first, results


def _decoded(engine: Engine, first: dict[int, tuple[list[int], int]], checks: dict[int, ReceiveCheck] | None = None
             ) -> dict[int, tuple[list[int], int] | str]:
    """Each reservation started on ``engine`` with P's first token (under its digests' check, if
    ``checks`` has one) and decoded, batched: its (output, accepted drafts), or why the check refused it."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    starts, refused = {}, {}
    for i, (tokens, _) in first.items():
        try:
            starts[i] = engine.start_reserved(str(i), tokens[0], params, check=(checks or {}).get(i))
        except HandoffCheckError as exc:
            refused[i] = str(exc)
    return {**refused, **{i: (starts[i].new_token_ids + ids, n) for i, (ids, n) in _drain(engine).items()}}


def test_handed_sidecar_draft_rows_decide_the_acceptance(tiny: Path, drafts: dict[str, Path], sides) -> None:
    """The decode engine's draft reads the rows the handoff wrote into its sidecar pool: as handed
    over, the accepted counts equal a single uncached engine's; with noise over them, they change
    (the output stays the target's)."""
    batch = _prompts()
    want = _uncached(tiny, drafts["sidecar"], batch)
    assert sides[1].engine.draft_pool is not None  # the wide draft's rows are shaped unlike the target's
    for noise in (False, True):
        got = _handed_over(sides, batch, noise)
        assert [ids for ids, _ in got.values()] == [ids for ids, _ in want.values()], noise
        counts = ([n for _, n in got.values()], [n for _, n in want.values()])
        assert (counts[0] != counts[1]) if noise else (counts[0] == counts[1]), counts


_EAGLE = {"speculative_algorithm": SpeculativeAlgorithm.EAGLE, "speculative_draft_layout": DraftLayout.SIDECAR}


@pytest.fixture(scope="module")
def eagle(tmp_path_factory) -> dict[str, Path]:
    """The target (with the word tokenizer; its second layer adds nothing, so it splits over two
    stages) and an EAGLE head agreeing with it now and then."""
    root = tmp_path_factory.mktemp("eagle")
    target = add_word_tokenizer(make_eagle_target(root / "target", layers=2), byte_level=True)
    return {"target": target, "head": make_mimic_eagle(target, root / "head", 0.1)}


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory) -> dict[str, Path]:
    """As ``eagle``, with an EAGLE-3 head: it reads the residuals entering the target's layers 0, 1
    and 2 (the embedding among them, which a first pipeline stage takes and sends on) and agrees
    with the target now and then."""
    root = tmp_path_factory.mktemp("eagle3")
    target = add_word_tokenizer(make_eagle_target(root / "target", layers=2, embed_rms=0.01), byte_level=True)
    return {"target": target, "head": make_mimic_eagle3(target, root / "head", 0.1, embed_feature=0.3)}


@pytest.fixture(scope="module")
def eagle_sides(eagle: dict[str, Path]) -> tuple[RankTransfer, RankTransfer]:
    """As ``sides``, with the EAGLE head (its rows and the target's hidden states in the sidecar)."""
    return _head_sides(eagle)


@pytest.fixture(scope="module")
def eagle3_sides(eagle3: dict[str, Path]) -> tuple[RankTransfer, RankTransfer]:
    """As ``eagle_sides``, with the EAGLE-3 head (its rows and the target's captures in the sidecar)."""
    return _head_sides(eagle3)


def _head_sides(models: dict[str, Path]) -> tuple[RankTransfer, RankTransfer]:
    """A prefill and an uncached decode engine of ``models``' target and EAGLE head, started as roles."""
    prefill = _engine(models["target"], models["head"], **_EAGLE)
    decode = _engine(models["target"], models["head"], cache=False, **_EAGLE)
    return NodeRankRole(Side.PREFILL, TransferOptions()).start(prefill), \
        NodeRankRole(Side.DECODE, TransferOptions()).start(decode)


# an EAGLE head's fixtures: its models, its sides
_HEADS = {"eagle": ("eagle", "eagle_sides"), "eagle3": ("eagle3", "eagle3_sides")}


@pytest.mark.parametrize("heads", list(_HEADS))
@pytest.mark.parametrize("part", ["none", "head", "features"])
def test_handed_eagle_rows_and_hidden_states_decide_the_acceptance(request, heads: str, part: str) -> None:
    """The decode engine's EAGLE head (EAGLE-1, EAGLE-3) reads the rows and the last prompt
    position's hidden state (EAGLE-3: its captures) the handoff wrote: as handed over, it drafts
    what a single uncached engine's head drafts, step by step, and the accepted counts are equal;
    with noise over the head's rows, or over the hidden states alone, the drafts and the counts
    change (output unchanged). The EAGLE-3 mimic passes the embedding's capture into its residual
    (``embed_feature``), where noise is not normalised away as in its attention's ``hidden_norm``."""
    eagle, eagle_sides = (request.getfixturevalue(name) for name in _HEADS[heads])
    batch = _prompts()
    with recorded_drafts() as want_drafts:
        want = _uncached(eagle["target"], eagle["head"], batch, **_EAGLE)
    plane = eagle_sides[1].engine.spec.drafter.plane.layers
    layers = {"none": slice(None), "head": slice(plane, None), "features": slice(0, plane)}[part]
    with recorded_drafts() as drafts:
        got = _handed_over(eagle_sides, batch, part != "none", layers)
    assert [ids for ids, _ in got.values()] == [ids for ids, _ in want.values()]
    assert (drafts != want_drafts) if part != "none" else (drafts == want_drafts)
    counts = ([n for _, n in got.values()], [n for _, n in want.values()])
    assert (counts[0] != counts[1]) if part != "none" else (counts[0] == counts[1]), counts
    assert sum(counts[1]) > 0


@pytest.mark.parametrize(("part", "heads"), [("draft", None), ("head", "eagle"), ("features", "eagle"),
                                             ("head", "eagle3"), ("features", "eagle3")],
                         ids=["draft", "head", "features", "eagle3-head", "eagle3-features"])
def test_handoff_integrity_covers_the_draft_rows(request, tiny: Path, drafts: dict[str, Path], part: str,
                                                 heads: str | None) -> None:
    """``--handoff-integrity`` (the sender's ``integrity``): the digests count the sidecar pool's
    layers after the target's (a draft model's rows; an EAGLE head's, its feature plane's first:
    EAGLE-3's, three hidden states wide, has more layers), so one bit flipped in one handed row of
    one request (the draft's last layer, the head's first, a hidden state of the plane's last
    layer) after it arrived fails that request's check, its pages freed, and never reaches a draft
    or an acceptance; the others pass (no false alarm) with a single uncached engine's outputs and
    accepted counts."""
    if heads is None:
        (p, d), model, head, spec = request.getfixturevalue("sides"), tiny, drafts["sidecar"], {}
    else:
        models, (p, d) = (request.getfixturevalue(name) for name in _HEADS[heads])
        model, head, spec = models["target"], models["head"], _EAGLE
    batch = _prompts()
    want = _uncached(model, head, batch, **spec)
    free = d.engine.allocator.num_free
    reserved, first, results = _hand((dataclasses.replace(p, integrity=True), d), batch)
    assert {len(r.digests) for r in results} == {d.engine.model_config.num_layers + d.engine.draft.geometry.num_layers}
    plane = d.engine.spec.drafter.plane.layers if part != "draft" else 0
    layer = {"draft": -1, "head": plane, "features": plane - 1}[part]
    row = d.engine.draft_pool.buffer[layer, 0, reserved[1].pages[2] * PAGE + 3]  # a K row of token 2 x PAGE + 3
    row.view(torch.int32)[0, 0] ^= 1  # its lowest bit: a draft it made might well be the same
    got = _decoded(d.engine, first, {i: ReceiveCheck(tuple(r.digests)) for i, r in enumerate(results)})
    assert "does not match its digest" in got[1], got[1]
    assert [got[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    assert d.engine.allocator.num_free == free  # D caches nothing: every page back, the refused one's too


def test_prefill_checks_the_destination_draft_pool(sides) -> None:
    """A prefill node with a sidecar draft hands its KV only into draft pools shaped like its own
    that hold the draft KV heads its ranks hold; the Reserve answer names each rank's pool."""
    mine, offered = [sides[0].arenas[0].draft], sides[1].arenas[0].draft
    named = pb.KVDestination(identity=pb.KVIdentity(head_dim=16, page_size=PAGE),
                             ranks=kv_ranks(sides[1].arenas, itemsize=4))
    assert destination_ranks(named, head_bytes=16 * 4)[0].draft == offered  # as the Reserve answer names it
    assert sidecar_problem([offered], mine, 3) is None
    assert "names no draft pool" in sidecar_problem([], mine, 3)
    assert "this node has none" in sidecar_problem([offered], [], 3)
    other = dataclasses.replace(offered, arena=dataclasses.replace(offered.arena, num_layers=1))
    assert "this node's draft" in sidecar_problem([other], mine, 3)
    assert "lies outside it" in sidecar_problem([offered], mine, offered.arena.num_pages)
    half = dataclasses.replace(offered, heads=dataclasses.replace(offered.heads, count=offered.heads.count // 2),
                               arena=dataclasses.replace(offered.arena, slot_bytes=offered.arena.slot_bytes // 2))
    assert "cannot hand the draft's KV over" in sidecar_problem([half], mine, 3)  # a draft KV head nowhere


def test_a_cp_decode_nodes_draft_pools_hold_their_own_pages(sides) -> None:
    """Under context parallelism each decode rank's draft pool holds the pages its rank owns, at
    local slots (docs/speculative.md, PD): the Reserve answer gives each pool its rank's ownership,
    so the handoff's draft routes write a page only to its owner; the prefill node checks a page
    table against the local slots and wants every draft KV head on every CP rank."""
    mine, offered = [sides[0].arenas[0].draft], sides[1].arenas[0].draft
    ranks = [dataclasses.replace(sides[1].arenas[0], owner=PageOwnership(r, 2)) for r in (0, 1)]
    named = pb.KVDestination(identity=pb.KVIdentity(head_dim=16, page_size=PAGE), ranks=kv_ranks(ranks, itemsize=4))
    pools = [r.draft for r in destination_ranks(named, head_bytes=16 * 4)]
    assert [p.owner for p in pools] == [PageOwnership(0, 2), PageOwnership(1, 2)]
    last = 2 * offered.arena.num_pages - 1  # as a logical id beyond one pool, as a local slot its last page
    assert sidecar_problem(pools, mine, last) is None
    assert "lies outside it" in sidecar_problem(pools, mine, last + 1)
    half = dataclasses.replace(pools[1], heads=dataclasses.replace(offered.heads, count=offered.heads.count // 2),
                               arena=dataclasses.replace(offered.arena, slot_bytes=offered.arena.slot_bytes // 2))
    assert "on CP rank 1" in sidecar_problem([pools[0], half], mine, 3)  # half the draft heads there


def test_a_failed_draft_transfer_fails_the_handoff(sides) -> None:
    """The draft pool's blocks aimed at an address D never registered: the pair's result fails
    though the target's part succeeded, and it ends (D's reservation is then given back)."""
    p, d = sides
    prompt = _prompts()[1]
    reserved = d.engine.reserve("99", prompt, MAX_NEW)
    good = d.arenas[0].draft
    bad = dataclasses.replace(d.arenas[0], draft=dataclasses.replace(good, arena=dataclasses.replace(good.arena,
                                                                                                      base=64)))
    handoff = p.handoff(HandoffPlan((bad,), tuple(reserved.pages), 0, len(prompt)))
    p.engine.add_request("99", prompt, SamplingParams(max_tokens=1, temperature=0), handoff=handoff)
    _drain(p.engine)
    assert handoff.result(30).error is not None
    assert handoff.parts[0].result(0).error is None  # the target's KV arrived; the pair still failed
    assert not handoff.busy() and handoff.state().failed and handoff.state().finished
    assert d.engine.cancel_reservation("99", writer_stopped=handoff.wait_stopped(1))
