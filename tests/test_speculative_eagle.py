"""EAGLE speculation (docs/speculative.md, EAGLE): a head fed with the target's hidden states drafts,
greedy output stays the target's (as transformers computes it), batched with chunked prefill; a
head that recomputes the target's layer (``make_mimic_eagle``) agrees with it, which it could not if
its rows, features or positions were misplaced; the published layout loads; bad flags exit 2.
Cache and PD: tests/test_speculative_cache.py, tests/test_speculative_pd.py; sampling:
tests/test_speculative_sampling.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.eagle_drafts import recorded_drafts
from helpers.engine_runs import assert_no_pages_held, spread_prompts
from helpers.rank_servers import NEW_TOKENS, hf_greedy
from helpers.tiny_models import make_eagle_target, make_mimic_eagle, make_mimic_eagle3, make_tiny_model
from safetensors.torch import load_file, save_file

from tierserve.cli.main import build_parser
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig, SpeculativeAlgorithm
from tierserve.engine.engine import Engine
from tierserve.engine.spec.drafts import SpecCounters
from tierserve.engine.spec.eagle import EagleDrafter
from tierserve.engine.spec.standalone import DraftRelay
from tierserve.model.eagle import (
    EAGLE3_ARCHITECTURE,
    EAGLE_ARCHITECTURE,
    eagle_spec,
    load_eagle,
    write_random_eagle,
    write_random_eagle3,
)
from tierserve.model.loader import load_model

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, Path]:
    """The one-layer target and its heads: random, and mimics with no and with some feature mixed in."""
    root = tmp_path_factory.mktemp("eagle")
    target = make_eagle_target(root / "target")
    return {"target": target, "random": write_random_eagle(target, root / "random"),
            "mimic": make_mimic_eagle(target, root / "mimic", 0.0),
            "mixed": make_mimic_eagle(target, root / "mixed", 0.1)}


@pytest.fixture(scope="module")
def heads3(tmp_path_factory) -> dict[str, Path]:
    """The two-layer target with a negligible embedding, and EAGLE-3 heads reading the inputs of its
    layers 0, 1 and 2 (the embedding, layer 0's output, the last layer's): random (with the target's
    LM head, or its own over 100 mapped tokens), and mimics with no and with some feature mixed in."""
    root = tmp_path_factory.mktemp("eagle3")
    target = make_eagle_target(root / "target", layers=2, embed_rms=0.01)
    return {"target": target, "random": write_random_eagle3(target, root / "random", (0, 1, 2)),
            "vocab": write_random_eagle3(target, root / "vocab", (0, 1, 2), draft_vocab=100, seed=1),
            "mimic": make_mimic_eagle3(target, root / "mimic", 0.0),
            "mixed": make_mimic_eagle3(target, root / "mixed", 0.1)}


def _engine(target: Path, head: Path | None, **kw) -> Engine:
    spec = {"speculative_draft_model_path": head, "speculative_algorithm": SpeculativeAlgorithm.EAGLE} if head else {}
    return Engine(EngineConfig(target, dtype="float32", page_size=4, **({"max_total_tokens": 2048} | spec | kw)))


# (fixture, head): EAGLE-1's random head and mimic; EAGLE-3's random heads (the target's LM head, its own over
# 100 mapped tokens) and mimic
GREEDY_HEADS = [("heads", "random"), ("heads", "mixed"), ("heads3", "random"), ("heads3", "vocab"), ("heads3", "mixed")]


@pytest.mark.parametrize(("fixture", "name"), GREEDY_HEADS, ids=[f"{f}-{n}" for f, n in GREEDY_HEADS])
def test_greedy_batched_chunked_output_equals_transformers(request, fixture: str, name: str) -> None:
    heads = request.getfixturevalue(fixture)
    prompts = spread_prompts(5, 9)
    want = hf_greedy(heads["target"], prompts)
    assert _engine(heads["target"], None).generate(prompts, GREEDY) == want
    engine = _engine(heads["target"], heads[name], chunked_prefill_size=8, speculative_num_steps=3)
    assert engine.generate(prompts, GREEDY) == want
    c = engine.spec.counters
    assert c.verify_steps > 0 and c.draft_tokens > 0 and c.prompt_catch_up_tokens == 0
    if name == "mixed":
        assert 0 < c.accepted_tokens < c.draft_tokens
    assert_no_pages_held(engine)


def test_greedy_under_preemption_equals_no_speculation(heads: dict[str, Path]) -> None:
    """A preempted request's rows and features are recomputed with its prefix (or restored with it)."""
    prompts = spread_prompts(8, 12, seed=9)
    want = _engine(heads["target"], None).generate(prompts, GREEDY)
    small = _engine(heads["target"], heads["mixed"], max_total_tokens=96, speculative_num_steps=4)
    assert small.generate(prompts, GREEDY) == want
    assert small.scheduler.num_preemptions > 0 and small.spec.counters.accepted_tokens > 0
    assert_no_pages_held(small)


@pytest.mark.parametrize(("fixture", "steps"), [("heads", 3), ("heads3", 1)], ids=["eagle1", "eagle3"])
def test_a_head_recomputing_the_target_agrees_with_it(request, fixture: str, steps: int) -> None:
    """The mimic's row of token s, fed the feature of s - 1, computes the target's position s but
    for slot 0 (EAGLE-3's, and for the residual it is fed: a thousandth of a capture): most of its
    drafts are accepted. A head reading the wrong row, feature (capture) or position would agree
    about as often as the random one (almost never). EAGLE-3's chain feeds the head's own output as
    the residual past its first draft, which the mimic cannot copy: one draft a step."""
    heads = request.getfixturevalue(fixture)
    prompts = spread_prompts(4, 12, seed=3)
    counts = {}
    for name in ("mimic", "random"):
        engine = _engine(heads["target"], heads[name], speculative_num_steps=steps)
        assert engine.generate(prompts, GREEDY) == _engine(heads["target"], None).generate(prompts, GREEDY)
        counts[name] = engine.spec.counters
    assert counts["mimic"].accepted_tokens > 0.6 * counts["mimic"].draft_tokens
    assert counts["random"].accepted_tokens < 0.1 * counts["random"].draft_tokens


def _rewritten(head: Path, tensors: dict[str, torch.Tensor], folder: Path) -> Path:
    """``head``'s config with ``tensors`` (renamed or added to its own) in ``folder``."""
    folder.mkdir()
    (folder / "config.json").write_text((head / "config.json").read_text())
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _same_drafts(target: Path, head: Path, other: Path, prompts: list[list[int]]) -> list:
    """Engines drafting with ``head`` and with ``other``, after checking that they answer ``prompts``
    alike with the same draft counts."""
    runs = [_engine(target, h, speculative_num_steps=2) for h in (head, other)]
    assert runs[0].generate(prompts, GREEDY) == runs[1].generate(prompts, GREEDY)
    assert runs[0].spec.counters == runs[1].spec.counters
    return runs


def test_published_layout_with_model_prefix_and_own_embedding_loads(heads: dict[str, Path], tmp_path: Path) -> None:
    """Checkpoints name tensors with or without ``model.``; a head may bring its own embedding (the
    target's, here: the same drafts); a tensor the layout has no place for is refused by name."""
    tensors = {f"model.{n}" if not n.startswith("lm_head") else n: t
               for n, t in load_file(str(heads["mixed"] / "model.safetensors")).items()}
    tensors["model.embed_tokens.weight"] = load_file(str(heads["target"] / "model.safetensors"))[
        "model.embed_tokens.weight"]
    own = _rewritten(heads["mixed"], tensors, tmp_path / "own")
    runs = _same_drafts(heads["target"], heads["mixed"], own, spread_prompts(2, 10, seed=4))
    assert runs[1].spec.drafter.head.embed_tokens is not None
    tensors["model.final_norm.weight"] = tensors["model.fc.weight"][0].clone()
    save_file(tensors, str(own / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensor model\.final_norm\.weight"):
        _engine(heads["target"], own)


def test_a_head_copies_the_embedding_a_last_stage_lacks(heads: dict[str, Path]) -> None:
    """A last pipeline stage (its LM head untied) holds no embedding: the head, which has none of
    its own, copies the target's from the target's folder, and refuses to load without it."""
    target = load_model(heads["target"], torch.device("cpu"), torch.float32)
    embedding = target.embed_tokens.weight.clone()
    target.embed_tokens = None  # as the last of two stages holds the target
    spec = eagle_spec(heads["mixed"], target.config.num_layers)
    with pytest.raises(ValueError, match="needs the target's folder"):
        load_eagle(spec, target, 1, torch.device("cpu"), torch.float32)
    head = load_eagle(spec, target, 1, torch.device("cpu"), torch.float32, heads["target"])
    assert torch.equal(head.embed_tokens.weight, embedding)


class _Twin:
    """The engine's EAGLE drafter with a ``DraftRelay`` beside it, as a pipeline stage without the
    head runs one: the relay takes the head's draws (the sampling rank's) and after every call
    must hold the head's books (``books``: per call, each request's ``draft_computed`` after the
    head's call and after the relay's, from the same start; ``hit``: the longest prefix hit seen)."""

    def __init__(self, real: EagleDrafter, keeps_chain: bool = False) -> None:
        self.real, self.draws, self.books, self.hit = real, [], [], 0
        real.tokens = _Draws(self.draws, record=True)  # as the sampling rank broadcasts them
        self.relay = DraftRelay(SpecCounters(), _Draws(self.draws, record=False), keeps_chain)

    def propose(self, batch, hooks):
        return self._both([s.request for s in batch], lambda d: d.propose(batch, hooks))

    def target_pass(self, spans, hidden, hooks) -> None:
        self.real.target_pass(spans, hidden, hooks)

    def sync(self, batch, hooks) -> None:
        self._both([s.request for s in batch], lambda d: d.sync(batch, hooks))

    def verified(self, request, drafted, accepted: int) -> None:
        self._both([request], lambda d: d.verified(request, drafted, accepted))

    def _both(self, requests, call):
        before = [r.draft_computed for r in requests]
        self.hit = max([self.hit, *(r.hit.num_tokens for r in requests)])
        out = call(self.real)
        after = [r.draft_computed for r in requests]
        for r, start in zip(requests, before, strict=True):
            r.draft_computed = start
        call(self.relay)
        self.books.append((after, [r.draft_computed for r in requests]))
        return out


class _Draws:
    """A ``TokenShare`` over one list: the head's appends its draws, the relay's takes them in order."""

    def __init__(self, draws: list[list[int]], record: bool) -> None:
        self.draws, self.record = draws, record

    def share(self, batch, count: int, sample) -> list[int]:
        if not self.record:
            return self.draws.pop(0)
        self.draws.append(sample())
        return self.draws[-1]


@pytest.mark.parametrize("keeps_chain", [False, True])
def test_a_stage_without_the_head_keeps_its_books(heads: dict[str, Path], keeps_chain: bool) -> None:
    """EAGLE at PP (docs/speculative.md, layouts): a stage without the head relays (``DraftRelay``)
    and must keep the head's ``draft_computed`` (which bounds what every stage caches) and prompt
    catch-up count through prefill chunks, verified chains and prefix hits, or the stages would
    cache other pages. The head recomputes accepted rows, so a relay keeping them as a draft
    model's (``keeps_chain``, STANDALONE's) parts from it."""
    engine = _engine(heads["target"], heads["mixed"], chunked_prefill_size=8, speculative_num_steps=3)
    twin = engine.spec.drafter = _Twin(engine.spec.drafter, keeps_chain)
    prompts = spread_prompts(4, 12, seed=5)
    assert engine.generate(prompts, GREEDY) == engine.generate(prompts, GREEDY)  # the second from L1
    assert engine.spec.counters.accepted_tokens > 0 and not twin.draws and twin.hit >= 8
    assert len(twin.books) > 20
    assert all(head == relay for head, relay in twin.books) is not keeps_chain
    assert twin.relay.counters.prompt_catch_up_tokens == engine.spec.counters.prompt_catch_up_tokens


def test_model_fetch_writes_a_random_head_for_a_target(heads: dict[str, Path], capsys) -> None:
    args = build_parser().parse_args(["model", "fetch", "--draft", "--eagle", "--target", str(heads["target"])])
    assert args.func(args) == 0
    head = Path(capsys.readouterr().out.strip().splitlines()[-1])
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == [EAGLE_ARCHITECTURE] and config["num_hidden_layers"] == 1
    assert "lm_head.weight" not in load_file(str(head / "model.safetensors"))  # shares the target's
    engine = _engine(heads["target"], head)
    assert engine.generate(spread_prompts(1, 6), GREEDY) == _engine(heads["target"], None).generate(
        spread_prompts(1, 6), GREEDY)


@pytest.mark.parametrize("flags, message", [
    (["--speculative-algorithm", "EAGLE"], "EAGLE needs --speculative-draft-model-path"),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "WIDE"],
     "hidden size (32) differs from the target's (64)"),
    (["--speculative-algorithm", "eagle", "--speculative-draft-model-path", "HEAD",
      "--speculative-ngram-window", "9"], "need --speculative-algorithm NGRAM"),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "EAGLE3"], "has no draft_vocab_size"),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "EAGLE3-DEEP"],
     "reads three distinct layers of the target's 1; the default layers give inputs of [2, 0, -2]"),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "TARGET"], "has no fc.weight"),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "SPECULATORS"],
     "a speculators-format head: flatten its transformer_layer_config"),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "HEADLESS"],
     "config.json has no 'num_attention_heads'"),
])
def test_bad_eagle_flags_are_refused_at_start(heads: dict[str, Path], tmp_path: Path, capsys, flags: list[str],
                                              message: str) -> None:
    names = {"HEAD": str(heads["random"]), "TARGET": str(heads["target"])}
    config = json.loads((heads["random"] / "config.json").read_text())
    if "WIDE" in flags:
        (tmp_path / "config.json").write_text(json.dumps(config | {"hidden_size": 32}))
        shutil.copy(heads["random"] / "model.safetensors", tmp_path / "model.safetensors")
        names["WIDE"] = str(tmp_path)
    if "EAGLE3" in flags or "EAGLE3-DEEP" in flags:  # EAGLE-3's names: a midlayer over 2H, fc over 3H, d2t
        (tmp_path / "config.json").write_text(json.dumps(config))
        d2t = {"d2t": torch.zeros(384, dtype=torch.int64)} if "EAGLE3" in flags else {}
        save_file({"midlayer.self_attn.q_proj.weight": torch.zeros(64, 128), "fc.weight": torch.zeros(64, 192)} | d2t,
                  str(tmp_path / "model.safetensors"))
        names["EAGLE3"] = names["EAGLE3-DEEP"] = str(tmp_path)
    if "SPECULATORS" in flags or "HEADLESS" in flags:  # configs this build cannot read: exit 2, not a traceback
        (tmp_path / "config.json").write_text(json.dumps(
            {"architectures": ["Eagle3Speculator"], "transformer_layer_config": config} if "SPECULATORS" in flags
            else {k: v for k, v in config.items() if k != "num_attention_heads"}))
        names["SPECULATORS"] = names["HEADLESS"] = str(tmp_path)
    args = build_parser().parse_args(["serve", "--model", str(heads["target"]), *[names.get(f, f) for f in flags]])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


def test_model_fetch_refuses_eagle_with_draft_layers(capsys) -> None:
    args = build_parser().parse_args(["model", "fetch", "--draft", "--eagle", "--draft-layers", "0,1"])
    assert args.func(args) == 2
    assert "does not go with --eagle" in capsys.readouterr().err


# EAGLE-3 (docs/speculative.md, EAGLE-3): the head reads three of the target's residual streams;
# its greedy outputs and agreement are checked with EAGLE-1's above


def test_the_target_captures_the_inputs_of_the_heads_layers(tmp_path: Path) -> None:
    """``capture_inputs``: the residual streams entering layers 0 and 2 equal transformers' hidden
    states there, and the stream after the last layer is what the final norm turns into the
    output: what SGLang and vLLM hand an EAGLE-3 head."""
    import transformers

    model_dir = make_tiny_model("llama", tmp_path / "deep", layers=4)
    head = write_random_eagle3(model_dir, tmp_path / "head", (0, 2, 4))
    engine = _engine(model_dir, head)
    prompt = spread_prompts(1, 11)[0]
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))  # one pass: the prompt's
    target = engine.model
    assert target.capture == (0, 2, 4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    first, third, last = target.captured.split(64, dim=-1)
    torch.testing.assert_close(first, states[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(third, states[2][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(target.norm(last), states[4][0], atol=1e-5, rtol=1e-5)


def test_a_draft_vocabulary_drafts_only_its_mapped_tokens(heads3: dict[str, Path]) -> None:
    """``d2t``: draft id d is target id d + d2t[d]; the head's logits over the target's vocabulary
    are -inf outside those ids, so it drafts nothing else, and sampling and verification see the
    target's ids."""
    engine = _engine(heads3["target"], heads3["vocab"], speculative_num_steps=3)
    head = engine.spec.drafter.head
    d2t = load_file(str(heads3["vocab"] / "model.safetensors"))["d2t"]
    assert torch.equal(head.hot_ids, d2t + torch.arange(100))
    finite = head.logits(torch.randn(3, 64)).isfinite()
    assert finite.shape == (3, 384) and torch.equal(finite.nonzero()[:, 1].unique(), head.hot_ids.sort().values)


def test_model_fetch_writes_an_eagle3_head_for_a_deep_enough_target(tmp_path: Path, capsys) -> None:
    """The published default reads the inputs of layers 2, L/2 and L-3: a seven-layer target has
    three distinct ones; a one-layer target is refused with the config key to set."""
    deep = make_tiny_model("llama", tmp_path / "deep", layers=7)
    fetch = ["model", "fetch", "--draft", "--eagle", "--eagle-layout", "eagle3", "--target"]
    args = build_parser().parse_args([*fetch, str(deep)])
    assert args.func(args) == 0
    head = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads((head / "config.json").read_text())["architectures"] == [EAGLE3_ARCHITECTURE]
    engine = _engine(deep, head)
    assert engine.model.capture == (2, 3, 4)
    assert engine.generate(spread_prompts(2, 6), GREEDY) == _engine(deep, None).generate(spread_prompts(2, 6), GREEDY)
    shallow = make_tiny_model("llama", tmp_path / "shallow", layers=1)
    args = build_parser().parse_args([*fetch, str(shallow)])
    assert args.func(args) == 2
    assert "eagle_aux_hidden_state_layer_ids" in capsys.readouterr().err


@pytest.mark.parametrize(("config", "inputs"), [
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, (2, 3, 4)),  # outputs of layers 1-3
    ({"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}, (2, 3, 4)),  # inputs of layers 2-4, at the top as vLLM reads
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 7]}}, (0, 3, 7)),  # the embedding, ..., the output
    ({}, (2, 3, 4)),  # the published default: inputs of layers 2, L/2, L-3
])
def test_eagle3_layer_ids_are_read_in_either_convention(tmp_path: Path, config: dict, inputs: tuple) -> None:
    """Published heads name their layers two ways (sgl-project/sglang#25454): ids from 1 are
    outputs (the next layer's input), others inputs; a seven-layer target captures those inputs."""
    deep = make_tiny_model("llama", tmp_path / "deep", layers=7)
    head = write_random_eagle3(deep, tmp_path / "head")
    raw = {k: v for k, v in json.loads((head / "config.json").read_text()).items() if k != "eagle_config"}
    (head / "config.json").write_text(json.dumps(raw | config))
    assert _engine(deep, head).model.capture == inputs


def test_norm_before_residual_feeds_the_normed_hidden_input_to_the_residual(heads3: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    """``norm_before_residual`` (vLLM's reading, the speculators format's heads): the same weights
    draft otherwise (the residual is hidden_norm(h), not h), and greedy output stays the target's."""
    plain = heads3["mixed"]
    normed = tmp_path / "normed"
    shutil.copytree(plain, normed)
    config = json.loads((plain / "config.json").read_text())
    (normed / "config.json").write_text(json.dumps(config | {"norm_before_residual": True}))
    prompts, runs = spread_prompts(3, 9, seed=2), []
    for head in (plain, normed):
        with recorded_drafts(lambda rid: int(rid.rpartition("-")[2])) as drafts:
            out = _engine(heads3["target"], head, speculative_num_steps=2).generate(prompts, GREEDY)
        runs.append((out, drafts))
    assert runs[0][0] == runs[1][0] == _engine(heads3["target"], None).generate(prompts, GREEDY)
    assert runs[0][1] != runs[1][1]


@pytest.mark.parametrize("key", ["norm_before_fc", "fc_norm"])
def test_an_eagle3_head_with_a_norm_before_fc_is_refused(heads3: dict[str, Path], tmp_path: Path, key: str) -> None:
    head = tmp_path / "head"
    shutil.copytree(heads3["random"], head)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(config | {key: True}))
    with pytest.raises(ValueError, match=f"{key}.*not supported"):
        _engine(heads3["target"], head)


def test_an_eagle3_head_named_as_vllm_names_it_loads(heads3: dict[str, Path], tmp_path: Path) -> None:
    """vLLM names the midlayer ``layers.0.`` (the heads its speculators tools write); with a
    ``model.`` prefix too: the same head, the same drafts and counts."""
    tensors = {("model." + n.replace("midlayer.", "layers.0.")) if n.startswith("midlayer.") else n: t
               for n, t in load_file(str(heads3["mixed"] / "model.safetensors")).items()}
    renamed = _rewritten(heads3["mixed"], tensors, tmp_path / "renamed")
    runs = _same_drafts(heads3["target"], heads3["mixed"], renamed, spread_prompts(3, 10, seed=4))
    assert runs[0].spec.counters.accepted_tokens > 0
