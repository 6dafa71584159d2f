"""Llama-style decoder (Llama, SmolLM2, Mistral without sliding window, Qwen2, Qwen3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.core.model_config import ModelConfig, ModelFamily
from tierserve.model.attention import AttentionBatch, KVStore, PagedAttention
from tierserve.model.layers import (
    ColumnParallelLinear,
    Embedding,
    GatedMLP,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
)
from tierserve.model.parallel import TensorParallel
from tierserve.model.pipeline import SOLE, PipelineStage
from tierserve.model.rope import RotaryEmbedding

RopeTables = tuple[torch.Tensor, torch.Tensor]


class SelfAttention(nn.Module):
    """QKV projection, optional per-head q/k norm (Qwen3), rope, paged attention, output projection."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel, in_features: int | None = None) -> None:
        """``layer_id``: the layer's index in this stage's KV pool (its own layers only);
        ``in_features``: the width q, k and v are projected from (default: the hidden size)."""
        super().__init__()
        shard = tp.heads(cfg.num_heads, cfg.num_kv_heads)
        self.heads, self.kv_heads, self.head_dim = shard.q_heads, shard.kv_heads, cfg.head_dim
        self.qkv_proj = QKVParallelLinear(in_features or cfg.hidden_size, cfg.head_dim, shard, cfg.attention_bias)
        o_bias = cfg.attention_bias and cfg.family is not ModelFamily.QWEN2  # Qwen2 biases q/k/v only
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, o_bias, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = PagedAttention(layer_id, self.heads, self.kv_heads, cfg.head_dim)

    def forward(self, rope: RopeTables, x: torch.Tensor, batch: AttentionBatch, kv: KVStore) -> torch.Tensor:
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.heads, self.head_dim)
        k = k.view(-1, self.kv_heads, self.head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(q, k, rope)
        return self.o_proj(self.attn(q, k, v, batch, kv))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)

    def forward(self, rope: RopeTables, x: torch.Tensor, batch: AttentionBatch, kv: KVStore) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """The whole model, or one rank's shard of it: its tensor-parallel heads (``tp``) of its pipeline
    stage's layers (``pp``). ``forward`` runs a flat batch of tokens; at the last stage it returns
    final hidden states, the same on every tensor rank; at other stages, after sending its output to
    the next stage, the stage's output. Parameters keep the checkpoint's names (``layers.<i>``)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, pp: PipelineStage = SOLE) -> None:
        super().__init__()
        self.config, self.pp = cfg, pp
        self.layer_ids = pp.layers(cfg.num_layers)
        # The first stage embeds; the last needs the embedding too when the LM head is tied to it.
        embeds = pp.first or (pp.last and cfg.tie_word_embeddings)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size) if embeds else None
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position, cfg.rope_scaling)
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, i - self.layer_ids.start, tp) for i in self.layer_ids})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if pp.last else None
        # Replicated: logits are computed on one rank only (docs/ranks.md).
        self.lm_head = None if cfg.tie_word_embeddings or not pp.last else ColumnParallelLinear.split(
            cfg.hidden_size, [cfg.vocab_size], False, TensorParallel()
        )
        self._head_t: torch.Tensor | None = None  # CPU only: a transposed copy for one-row logits
        self.capture: tuple[int, ...] = ()  # ``capture_inputs``
        self.captured: torch.Tensor | None = None

    def capture_inputs(self, layers: tuple[int, ...]) -> None:
        """From now on each forward keeps the residual stream entering each of ``layers`` (ascending;
        ``num_layers``: the last layer's output, before the final norm): an EAGLE-3 head's features
        (docs/speculative.md, EAGLE-3). A stage sends the ones it took on with its output, so the
        last stage's ``captured`` [T, len(layers) * hidden] holds them all, in the order of ``layers``."""
        self.capture = tuple(sorted(set(layers)))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, kv: KVStore
    ) -> torch.Tensor:
        x, kept = self._stage_input(input_ids)
        rope = self.rope.tables(positions, x.dtype)
        for i, layer in self.layers.items():
            if int(i) in self.capture:
                kept.append(x)
            x = layer(rope, x, batch, kv)
        if self.pp.last and self.config.num_layers in self.capture:
            kept.append(x)
        if not self.pp.last:
            self.pp.send(torch.cat([x, *kept], dim=-1) if kept else x)
            return x
        self.captured = torch.cat(kept, dim=-1) if kept else None
        return self.norm(x)

    def elsewhere(self, name: str) -> bool:
        """Whether the parameter ``name`` (our naming) is one another pipeline stage holds: a layer
        outside this stage's range, or the embedding, final norm or head where this stage has none."""
        head, _, rest = name.partition(".")
        if head == "layers":
            layer = rest.partition(".")[0]
            return layer.isdigit() and int(layer) < self.config.num_layers and layer not in self.layers
        return head in ("embed_tokens", "norm", "lm_head") and getattr(self, head) is None

    def _stage_input(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The stage's input and the captures earlier stages took (``capture_inputs``)."""
        if self.pp.first:
            return self.embed_tokens(input_ids), []
        dtype = next(iter(self.layers.values())).input_layernorm.weight.dtype  # the stages' common dtype
        hidden, earlier = self.config.hidden_size, sum(1 for i in self.capture if i < self.layer_ids.start)
        received = self.pp.receive(input_ids.shape[0], hidden * (1 + earlier), dtype, input_ids.device)
        x, *kept = received.split(hidden, dim=-1)
        return x, list(kept)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, vocab] for the given final hidden states."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if hidden.device.type != "cpu":
            return F.linear(hidden, weight).float()
        # Same product, but on CPU BLAS picks much faster kernels for a large vocabulary this way:
        # W @ h^T for several rows, h @ W^T with W^T contiguous for one (about 1.6x each).
        if hidden.shape[0] > 1:
            return (weight @ hidden.t()).t().float()
        return (hidden @ self._transposed_head(weight)).float()

    def weights_changed(self) -> None:
        """Drops copies derived from the weights; call after loading new weights in place."""
        self._head_t = None

    def _transposed_head(self, weight: torch.Tensor) -> torch.Tensor:
        if self._head_t is None:
            self._head_t = weight.t().contiguous()
        return self._head_t
