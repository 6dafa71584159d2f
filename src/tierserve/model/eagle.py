"""EAGLE draft heads (docs/speculative.md, EAGLE): a small decoder fed with the target's last hidden
state and the next token's embedding, predicting the target's next hidden state.

The EAGLE-1 layout as SGLang's and vLLM's ``LlamaForCausalLMEagle`` load it: ``fc`` maps
concat(embed(token), feature) [2H] to H, then Llama decoder layers (the first without its input
norm), no final norm, then the LM head. The embedding and the head are the target's unless the
checkpoint has its own (``embed_tokens.weight``, ``lm_head.weight``); tensor names may carry a
``model.`` prefix. The feature is the target's final hidden state (after its norm), as SGLang and
vLLM capture it. On a last pipeline stage, which holds the target's LM head but not its embedding
(unless tied), the head loads its own copy of the target's embedding from the target's checkpoint."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from itertools import chain, islice
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.core.model_config import ModelConfig
from tierserve.model.attention import AttentionBatch, KVStore
from tierserve.model.draft import write_model_folder
from tierserve.model.layers import ColumnParallelLinear, Embedding, copy_whole
from tierserve.model.llama import CausalLM, DecoderLayer
from tierserve.model.loader import checkpoint_tensors, parameter_target
from tierserve.model.parallel import TensorParallel
from tierserve.model.rope import RotaryEmbedding

EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle"
_OWN = ("embed_tokens.weight", "lm_head.weight")


def feature_layers(hidden_size: int, num_kv_heads: int, head_dim: int) -> int:
    """KV layers of the head's pool that hold one target hidden state per slot (its K and V rows
    side by side): the feature plane (``engine/spec/eagle.py``)."""
    return math.ceil(hidden_size / (2 * num_kv_heads * head_dim))


class EagleHead(nn.Module):
    """An EAGLE-1 head. ``first_layer``: the KV layer of the store its layer 0 uses (the feature
    plane's layers come first). ``target``: the model it drafts for, whose embedding and LM head it
    uses where it has none of its own (kept outside the module: its weights are not the head's).
    Where ``target`` has no embedding (a last pipeline stage, its LM head untied) the head has one,
    a copy of the target's (``load_eagle`` reads it from the target's checkpoint)."""

    def __init__(self, cfg: ModelConfig, first_layer: int, target: CausalLM, own: set[str], fc_bias: bool) -> None:
        super().__init__()
        self.config, self.__dict__["target"] = cfg, target
        hidden, tp = cfg.hidden_size, TensorParallel()
        embeds = "embed_tokens.weight" in own or target.embed_tokens is None
        self.embed_tokens = Embedding(cfg.vocab_size, hidden) if embeds else None
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position, cfg.rope_scaling)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, first_layer + i, tp) for i in range(cfg.num_layers)})
        self.layers["0"].input_layernorm = nn.Identity()  # EAGLE removed it: fc's output goes straight in
        self.lm_head = ColumnParallelLinear.split(hidden, [cfg.vocab_size], False, tp) if "lm_head.weight" in own \
            else None

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                batch: AttentionBatch, kv: KVStore) -> torch.Tensor:
        """The head's output per token [T, H] (no final norm), from each token and the feature it
        is paired with (``features`` [T, H])."""
        embed = self.embed_tokens(input_ids) if self.embed_tokens is not None else self.target.embed_tokens(input_ids)
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


def eagle_config(draft_dir: Path) -> tuple[ModelConfig, set[str], bool]:
    """The head's shapes, the tensors it brings of its own (embedding, LM head) and whether ``fc``
    has a bias, read from ``draft_dir``'s config.json and tensor names."""
    cfg = ModelConfig.from_dir(draft_dir)
    names = _names(draft_dir)
    return cfg, {n for n in _OWN if n in names}, "fc.bias" in names


def layout_problem(draft_dir: Path) -> str | None:
    """Why ``draft_dir`` is not an EAGLE-1 head, from its tensor names alone (None: it is one)."""
    names = _names(draft_dir)
    if any(n.startswith(("midlayer.", "d2t", "t2d")) for n in names):
        return (f"{draft_dir} is an EAGLE-3 head (midlayer, d2t): only the EAGLE-1 layout is supported "
                "(docs/speculative.md)")
    if "fc.weight" not in names:
        return f"{draft_dir} is not an EAGLE-1 head: it has no fc.weight"
    return None


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


def load_eagle(draft_dir: str | Path, target: CausalLM, first_layer: int, device: torch.device,
               dtype: torch.dtype, target_dir: Path | None = None) -> EagleHead:
    """The EAGLE head of ``draft_dir`` on ``device`` in ``dtype``, drafting for ``target`` (loaded
    from ``target_dir``, which must be given where ``target`` has no embedding and the head none of
    its own: the head then copies it); raises ``ValueError`` naming a tensor the layout has no place
    for, or a parameter left unloaded."""
    draft_dir = Path(draft_dir)
    cfg, own, fc_bias = eagle_config(draft_dir)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = EagleHead(cfg, first_layer, target, own, fc_bias)
    finally:
        torch.set_default_dtype(previous)
    borrowed = head.embed_tokens is not None and "embed_tokens.weight" not in own
    if borrowed and target_dir is None:
        raise ValueError(f"{draft_dir}: the target has no embedding here and the head none of its own; "
                         "load_eagle needs the target's folder to copy it from")
    tensors = checkpoint_tensors(draft_dir)
    _load(head, draft_dir, chain(tensors, _target_embedding(Path(target_dir))) if borrowed else tensors)
    return head.eval().requires_grad_(False)


def _target_embedding(target_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The target checkpoint's embedding tensor, read alone (its name and tensor)."""
    return islice(checkpoint_tensors(target_dir, lambda name: parameter_target(name)[0] == "embed_tokens.weight"), 1)


def _load(head: EagleHead, draft_dir: Path, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    params, loaded = dict(head.named_parameters()), set()
    for ckpt_name, tensor in tensors:
        name, shard = parameter_target(ckpt_name)
        if name == "layers.0.input_layernorm.weight" or name.endswith("rotary_emb.inv_freq"):
            continue  # some conversions keep the unused norm
        if name not in params:
            raise ValueError(f"{draft_dir}: unexpected tensor {ckpt_name} for an EAGLE head")
        param = params[name]
        getattr(param, "weight_loader", copy_whole)(param, tensor.to(param.dtype), shard)
        loaded.add((name, shard))
    counts = {n: sum(1 for m, _ in loaded if m == n) for n in params}
    missing = sorted(n for n, p in params.items() if counts[n] < getattr(p, "num_shards", 1))
    if missing:
        raise ValueError(f"{draft_dir}: the EAGLE head lacks {missing[:5]}")


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


def random_eagle_for(target_dir: Path) -> Path:
    """The random head of ``write_random_eagle`` for ``target_dir``, beside it as
    ``<name>-eagle-random`` (written once)."""
    out = target_dir.parent / f"{target_dir.name}-eagle-random"
    return out if (out / "model.safetensors").is_file() else write_random_eagle(target_dir, out)


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


def _init(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Norm weights 1, matrices N(0, 0.02) as Hugging Face initialises Llama."""
    return torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02
