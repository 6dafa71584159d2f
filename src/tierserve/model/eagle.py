"""EAGLE draft heads (docs/speculative.md, EAGLE): a small decoder fed with the target's last hidden
state and the next token's embedding, predicting the target's next hidden state.

The EAGLE-1 layout as SGLang's and vLLM's ``LlamaForCausalLMEagle`` load it: ``fc`` maps
concat(embed(token), feature) [2H] to H, then Llama decoder layers (the first without its input
norm), no final norm, then the LM head. The embedding and the head are the target's unless the
checkpoint has its own (``embed_tokens.weight``, ``lm_head.weight``); tensor names may carry a
``model.`` prefix. The feature is the target's final hidden state (after its norm), as SGLang and
vLLM capture it. On a last pipeline stage, which holds the target's LM head but not its embedding
(unless tied), the head loads its own copy of the target's embedding from the target's checkpoint.

The EAGLE-3 layout as SGLang's ``LlamaForCausalLMEagle3`` and vLLM's ``Eagle3LlamaForCausalLM`` load it
(its layer named ``midlayer.`` or, as vLLM names it, ``layers.0.``; told from EAGLE-1 by its ``hidden_norm``):
``fc`` maps three of the target's residual streams (entering the layers ``capture_layers`` names) [3H]
to H; one decoder layer, ``midlayer``, whose attention reads concat(input_layernorm(embed(token)),
hidden_norm(h)) [2H] with h as the residual (hidden_norm(h) with ``norm_before_residual``, as vLLM
reads it); a final ``norm``; an LM head over ``draft_vocab_size`` tokens whose ids ``d2t`` maps to
the target's (target = draft + d2t[draft]). A chain step past the first
feeds the head's own output (before its norm), which is H wide and skips ``fc``."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from itertools import chain, islice
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.core.model_config import ModelConfig
from tierserve.model.attention import AttentionBatch, KVStore
from tierserve.model.draft import write_model_folder
from tierserve.model.layers import ColumnParallelLinear, Embedding, GatedMLP, RMSNorm, copy_whole
from tierserve.model.llama import CausalLM, DecoderLayer, RopeTables, SelfAttention
from tierserve.model.loader import checkpoint_tensors, parameter_target
from tierserve.model.parallel import TensorParallel
from tierserve.model.rope import RotaryEmbedding

EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle"
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
_OWN = ("embed_tokens.weight", "lm_head.weight")


class EagleLayout(Enum):
    """The published checkpoint layouts (docs/speculative.md, EAGLE)."""

    EAGLE1 = "eagle1"
    EAGLE3 = "eagle3"


@dataclass(frozen=True)
class EagleSpec:
    """What a head's ``folder`` says about it: its ``layout``, the tensors it brings of its own
    (embedding, LM head), whether ``fc`` has a bias, and for EAGLE-3 the target layers whose inputs
    it reads (``capture``, ``CausalLM.capture_inputs``), the draft vocabulary's size and where its
    layer norms its hidden input."""

    folder: Path
    config: ModelConfig
    layout: EagleLayout
    own: frozenset[str]
    fc_bias: bool
    capture: tuple[int, ...] = ()
    draft_vocab: int | None = None
    norm_before_residual: bool = False  # EAGLE-3 (vLLM's, the speculators format's): the residual is hidden_norm(h)

    @property
    def feature_width(self) -> int:
        """The width of one feature row the target hands the head: its final hidden state
        (EAGLE-1) or the captured residual streams side by side (EAGLE-3)."""
        return self.config.hidden_size * max(1, len(self.capture))

    @property
    def plane_layers(self) -> int:
        """KV layers of the head's pool that hold its features (``feature_layers``)."""
        return feature_layers(self.feature_width, self.config.num_kv_heads, self.config.head_dim)


def feature_layers(width: int, num_kv_heads: int, head_dim: int) -> int:
    """KV layers of the head's pool that hold one feature row of ``width`` per slot (its K and V rows
    side by side): the feature plane (``engine/spec/eagle.py``)."""
    return math.ceil(width / (2 * num_kv_heads * head_dim))


class _HeadFrame(nn.Module):
    """What an EAGLE head of either layout has around its layers (``spec``, ``target``: as for
    ``EagleHead``): its config, the target it drafts for (kept outside the module: its weights are
    not the head's), an embedding of its own where it needs one (``_own_embedding``; ``embed``
    uses the target's otherwise), ``fc`` from ``fc_in`` feature columns to the hidden size, and the
    rope."""

    def __init__(self, spec: EagleSpec, target: CausalLM, fc_in: int) -> None:
        super().__init__()
        cfg = spec.config
        self.config, self.__dict__["target"] = cfg, target
        self.embed_tokens = _own_embedding(spec, target)
        self.fc = nn.Linear(fc_in, cfg.hidden_size, bias=spec.fc_bias)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position, cfg.rope_scaling)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens if self.embed_tokens is not None else self.target.embed_tokens)(input_ids)


class EagleHead(_HeadFrame):
    """An EAGLE-1 head (``spec``: its folder's, ``eagle_spec``). ``first_layer``: the KV layer of
    the store its layer 0 uses (the feature plane's layers come first). ``target``: the model it
    drafts for, whose embedding and LM head it uses where it has none of its own (kept outside the
    module: its weights are not the head's). Where ``target`` has no embedding (a last pipeline
    stage, its LM head untied) the head has one, a copy of the target's (``load_eagle`` reads it
    from the target's checkpoint)."""

    def __init__(self, spec: EagleSpec, first_layer: int, target: CausalLM) -> None:
        super().__init__(spec, target, 2 * spec.config.hidden_size)
        cfg, tp = spec.config, TensorParallel()
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, first_layer + i, tp) for i in range(cfg.num_layers)})
        self.layers["0"].input_layernorm = nn.Identity()  # EAGLE removed it: fc's output goes straight in
        self.lm_head = _own_lm_head(spec, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                batch: AttentionBatch, kv: KVStore) -> torch.Tensor:
        """The head's output per token [T, H] (no final norm), from each token and the feature it
        is paired with (``features`` [T, H])."""
        embed = self.embed(input_ids)
        x = self.fc(torch.cat([embed, features.to(embed.dtype)], dim=-1))
        rope = self.rope.tables(positions, x.dtype)
        for layer in self.layers.values():
            x = layer(rope, x, batch, kv)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, vocab] of the head's outputs: its own head's, else the target's."""
        if self.lm_head is None:
            return self.target.logits(hidden)
        return F.linear(hidden, self.lm_head.weight).float()


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer (``midlayer``): attention reads the normed token embedding and the
    normed hidden input side by side [2H]; the residual is the hidden input, or with
    ``norm_before_residual`` the normed hidden input."""

    def __init__(self, cfg: ModelConfig, layer_id: int, norm_before_residual: bool = False) -> None:
        super().__init__()
        hidden, tp = cfg.hidden_size, TensorParallel()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_id, tp, in_features=2 * hidden)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, cfg.mlp_bias, tp)

    def forward(self, rope: RopeTables, embed: torch.Tensor, x: torch.Tensor, batch: AttentionBatch,
                kv: KVStore) -> torch.Tensor:
        normed = self.hidden_norm(x)
        h = torch.cat([self.input_layernorm(embed), normed], dim=-1)
        x = (normed if self.norm_before_residual else x) + self.self_attn(rope, h, batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(_HeadFrame):
    """An EAGLE-3 head (module docstring), the same contract as ``EagleHead``: ``forward`` returns
    its output before the final norm (what a chain step feeds back), ``logits`` the target's
    vocabulary's (a draft vocabulary's ids mapped by ``d2t``; the tokens outside it -inf)."""

    def __init__(self, spec: EagleSpec, first_layer: int, target: CausalLM) -> None:
        super().__init__(spec, target, spec.feature_width)
        cfg = spec.config
        self.midlayer = Eagle3Layer(cfg, first_layer, spec.norm_before_residual)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        vocab = spec.draft_vocab or cfg.vocab_size
        self.lm_head = _own_lm_head(spec, vocab)
        # the target id of each draft id (``d2t``: their difference); None: the vocabularies are one
        self.register_buffer("hot_ids", torch.arange(vocab) if spec.draft_vocab else None, persistent=False)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                batch: AttentionBatch, kv: KVStore) -> torch.Tensor:
        """The head's output per token [T, H] (before its norm), from each token and the feature it
        is paired with: the target's captures [T, 3H], which go through ``fc``, or [T, H], the
        head's own output at the chain step before."""
        embed = self.embed(input_ids)
        features = features.to(embed.dtype)
        x = self.fc(features) if features.shape[-1] != self.config.hidden_size else features
        return self.midlayer(self.rope.tables(positions, x.dtype), embed, x, batch, kv)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, target vocab] of the head's outputs."""
        normed = self.norm(hidden)
        if self.lm_head is None:
            return self.target.logits(normed)
        logits = F.linear(normed, self.lm_head.weight).float()
        if self.hot_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.target.config.vocab_size), float("-inf"))
        full[:, self.hot_ids] = logits
        return full


def _own_embedding(spec: EagleSpec, target: CausalLM) -> Embedding | None:
    """The head's own embedding, where its checkpoint brings one or ``target`` has none here (a last
    pipeline stage: ``load_eagle`` copies the target's); None: it embeds with the target's."""
    own = "embed_tokens.weight" in spec.own or target.embed_tokens is None
    return Embedding(spec.config.vocab_size, spec.config.hidden_size) if own else None


def _own_lm_head(spec: EagleSpec, vocab: int) -> ColumnParallelLinear | None:
    """The head's own LM head over ``vocab`` tokens, where its checkpoint brings one; None: it uses
    the target's."""
    if "lm_head.weight" not in spec.own:
        return None
    return ColumnParallelLinear.split(spec.config.hidden_size, [vocab], False, TensorParallel())


def eagle_spec(draft_dir: Path, target_layers: int) -> EagleSpec:
    """What ``draft_dir``'s config.json and tensor names say about its head, for a target of
    ``target_layers`` layers; ``ValueError`` when it is no EAGLE head, its captures do not fit, or
    it asks for a variant this build does not run."""
    draft_dir = Path(draft_dir)
    names = _names(draft_dir)
    cfg = ModelConfig.from_dir(draft_dir)
    own, fc_bias = frozenset(n for n in _OWN if n in names), "fc.bias" in names
    if "fc.weight" not in names:
        raise ValueError(f"{draft_dir} is not an EAGLE head: it has no fc.weight")
    if not any(n.startswith("midlayer.") or n.endswith(".hidden_norm.weight") for n in names):
        return EagleSpec(draft_dir, cfg, EagleLayout.EAGLE1, own, fc_bias)
    raw = json.loads((draft_dir / "config.json").read_text())
    draft_vocab = raw.get("draft_vocab_size") if "d2t" in names else None
    if "d2t" in names and not draft_vocab:
        raise ValueError(f"{draft_dir}: the head maps its vocabulary (d2t) but its config.json has no draft_vocab_size")
    unsupported = [key for key in ("norm_before_fc", "fc_norm") if raw.get(key)]
    if unsupported:
        raise ValueError(f"{draft_dir}: EAGLE-3 heads with {', '.join(unsupported)} (a norm over the captures "
                         "before fc) are not supported (docs/speculative.md, EAGLE-3)")
    return EagleSpec(draft_dir, cfg, EagleLayout.EAGLE3, own, fc_bias, capture_layers(raw, target_layers, draft_dir),
                     draft_vocab, bool(raw.get("norm_before_residual", False)))


def capture_layers(raw: dict, target_layers: int, draft_dir: Path) -> tuple[int, ...]:
    """The target layers whose inputs an EAGLE-3 head reads (``target_layers``: the last one's
    output). Its config's ``eagle_aux_hidden_state_layer_ids`` (at the top, as vLLM reads it, or in
    ``eagle_config``, as SGLang does) comes in two conventions, told apart as SGLang does
    (sgl-project/sglang#25454): ids starting at 1 name layers whose outputs it reads (the input of
    the next), others the layers whose inputs it reads (no head reads the embedding's output as
    layer 1's). Without ids: the published default, the inputs of layers 2, L/2 and L-3."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids:
        layers = tuple(i + 1 for i in ids) if ids[0] == 1 else tuple(ids)
    else:
        layers = (2, target_layers // 2, target_layers - 3)
    if len(set(layers)) != 3 or not all(0 <= i <= target_layers for i in layers):
        source = f"eagle_aux_hidden_state_layer_ids {list(ids)}" if ids else "the default layers"
        raise ValueError(f"{draft_dir}: an EAGLE-3 head reads three distinct layers of the target's "
                         f"{target_layers}; {source} give inputs of {list(layers)} (set "
                         "eagle_aux_hidden_state_layer_ids in its config.json)")
    return tuple(sorted(layers))


def _names(draft_dir: Path) -> set[str]:
    """Our names of the checkpoint's tensors, read without loading them."""
    from safetensors import safe_open

    files = sorted(Path(draft_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{draft_dir}: no *.safetensors files")
    names = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names |= {parameter_target(name)[0] for name in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    return names


def load_eagle(spec: EagleSpec, target: CausalLM, first_layer: int, device: torch.device,
               dtype: torch.dtype, target_dir: Path | None = None) -> EagleHead | Eagle3Head:
    """The EAGLE head ``spec`` describes (either layout; ``eagle_spec`` for ``target``) on ``device``
    in ``dtype``, drafting for ``target`` (loaded from ``target_dir``, which must be given where
    ``target`` has no embedding and the head none of its own: the head then copies it); raises
    ``ValueError`` naming a tensor the layout has no place for, or a parameter left unloaded."""
    draft_dir = spec.folder
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = (EagleHead if spec.layout is EagleLayout.EAGLE1 else Eagle3Head)(spec, first_layer, target)
    finally:
        torch.set_default_dtype(previous)
    borrowed = head.embed_tokens is not None and "embed_tokens.weight" not in spec.own
    if borrowed and target_dir is None:
        raise ValueError(f"{draft_dir}: the target has no embedding here and the head none of its own; "
                         "load_eagle needs the target's folder to copy it from")
    tensors = checkpoint_tensors(draft_dir)
    _load(head, draft_dir, chain(tensors, _target_embedding(Path(target_dir))) if borrowed else tensors)
    return head.eval().requires_grad_(False)


def _target_embedding(target_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The target checkpoint's embedding tensor, read alone (its name and tensor)."""
    return islice(checkpoint_tensors(target_dir, lambda name: parameter_target(name)[0] == "embed_tokens.weight"), 1)


def _load(head: EagleHead | Eagle3Head, draft_dir: Path, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    params, loaded = dict(head.named_parameters()), set()
    for ckpt_name, tensor in tensors:
        name, shard = parameter_target(ckpt_name)
        if isinstance(head, Eagle3Head) and name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")  # vLLM's name for it (its speculators' heads)
        if name == "layers.0.input_layernorm.weight" or name.endswith("rotary_emb.inv_freq") or name == "t2d":
            continue  # some conversions keep the unused norm; t2d is d2t's inverse, for training
        if name == "d2t" and isinstance(head, Eagle3Head) and head.hot_ids is not None:
            _load_hot_ids(head, draft_dir, tensor)
            continue
        if name not in params:
            raise ValueError(f"{draft_dir}: unexpected tensor {ckpt_name} for an EAGLE head")
        param = params[name]
        getattr(param, "weight_loader", copy_whole)(param, tensor.to(param.dtype), shard)
        loaded.add((name, shard))
    counts = {n: sum(1 for m, _ in loaded if m == n) for n in params}
    missing = sorted(n for n, p in params.items() if counts[n] < getattr(p, "num_shards", 1))
    if missing:
        raise ValueError(f"{draft_dir}: the EAGLE head lacks {missing[:5]}")


def _load_hot_ids(head: Eagle3Head, draft_dir: Path, d2t: torch.Tensor) -> None:
    """The target id of each draft id: d2t holds their differences (as SGLang and vLLM read it)."""
    if d2t.shape != head.hot_ids.shape:
        raise ValueError(f"{draft_dir}: d2t has {tuple(d2t.shape)} entries, draft_vocab_size is {len(head.hot_ids)}")
    hot = d2t.to(torch.int64) + torch.arange(len(d2t))
    vocab = head.target.config.vocab_size
    if hot.min() < 0 or hot.max() >= vocab or len(hot.unique()) != len(hot):
        raise ValueError(f"{draft_dir}: d2t maps draft ids outside the target's {vocab} tokens or two onto one")
    head.hot_ids.copy_(hot)


def write_random_eagle(target_dir: Path, out_dir: Path, layers: int = 1, seed: int = 0) -> Path:
    """Writes to ``out_dir`` (replacing it) a randomly initialised EAGLE-1 head for the model in
    ``target_dir``: its shapes, no embedding or LM head (the target's are used). For tests and for
    measuring a speculative step's cost: it drafts almost nothing the target accepts."""
    target = ModelConfig.from_dir(target_dir)
    config = _eagle_json(json.loads((target_dir / "config.json").read_text()), target, layers)
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, target.torch_dtype, torch.float32)
    tensors = {name: _init(shape, gen).to(dtype) for name, shape in _shapes(target, layers).items()}
    return write_model_folder(out_dir, config, tensors)


def write_random_eagle3(target_dir: Path, out_dir: Path, capture: tuple[int, ...] | None = None,
                        draft_vocab: int | None = None, seed: int = 0, norm_before_residual: bool = False) -> Path:
    """Writes to ``out_dir`` (replacing it) a randomly initialised EAGLE-3 head for the model in
    ``target_dir``: ``capture`` its config's ``eagle_aux_hidden_state_layer_ids`` (read as
    ``capture_layers`` says; None: the published default), with ``draft_vocab`` its own LM head over
    that many of the target's tokens (a seeded choice, mapped by ``d2t``; else the target's head),
    ``norm_before_residual`` in its config."""
    target = ModelConfig.from_dir(target_dir)
    config = _eagle_json(json.loads((target_dir / "config.json").read_text()), target, 1) | {
        "architectures": [EAGLE3_ARCHITECTURE]}
    if capture is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(capture)}
    if norm_before_residual:
        config["norm_before_residual"] = True
    capture_layers(config, target.num_layers, out_dir)  # a head the target could not feed is refused now
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, target.torch_dtype, torch.float32)
    tensors = {name: _init(shape, gen).to(dtype) for name, shape in _shapes3(target, draft_vocab).items()}
    if draft_vocab:
        config["draft_vocab_size"] = draft_vocab
        hot = torch.randperm(target.vocab_size, generator=gen)[:draft_vocab].sort().values
        tensors["d2t"] = hot - torch.arange(draft_vocab)
        tensors["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, hot, True)
    return write_model_folder(out_dir, config, tensors)


def random_eagle_for(target_dir: Path, layout: EagleLayout = EagleLayout.EAGLE1) -> Path:
    """The random head of ``write_random_eagle`` (``write_random_eagle3``) for ``target_dir``,
    beside it as ``<name>-eagle-random`` (``<name>-eagle3-random``), written once."""
    out = target_dir.parent / f"{target_dir.name}-{'eagle' if layout is EagleLayout.EAGLE1 else 'eagle3'}-random"
    if (out / "model.safetensors").is_file():
        return out
    return write_random_eagle(target_dir, out) if layout is EagleLayout.EAGLE1 else write_random_eagle3(target_dir, out)


def _eagle_json(config: dict, target: ModelConfig, layers: int) -> dict:
    """The target's config as a Llama-layout head's: the target's q/k norm and biases are not part of it."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "torch_dtype",
            "bos_token_id", "eos_token_id")
    return {k: config[k] for k in keep if k in config} | {
        "architectures": [EAGLE_ARCHITECTURE], "model_type": "llama", "num_hidden_layers": layers,
        "head_dim": target.head_dim, "num_key_value_heads": target.num_kv_heads, "tie_word_embeddings": False}


def _shapes(cfg: ModelConfig, layers: int) -> dict[str, tuple[int, ...]]:
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (h, 2 * h)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter), p + "post_attention_layernorm.weight": (h,)}
        if i:
            shapes[p + "input_layernorm.weight"] = (h,)
    return shapes


def _shapes3(cfg: ModelConfig, draft_vocab: int | None) -> dict[str, tuple[int, ...]]:
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    p = "midlayer."
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, 3 * h), "norm.weight": (h,), p + "self_attn.q_proj.weight": (q, 2 * h),
        p + "self_attn.k_proj.weight": (kv, 2 * h), p + "self_attn.v_proj.weight": (kv, 2 * h),
        p + "self_attn.o_proj.weight": (h, q), p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter),
        p + "input_layernorm.weight": (h,), p + "hidden_norm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    if draft_vocab:
        shapes["lm_head.weight"] = (draft_vocab, h)
    return shapes


def _init(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Norm weights 1, matrices N(0, 0.02) as Hugging Face initialises Llama."""
    return torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02
