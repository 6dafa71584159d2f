"""Model architecture description read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any


class ModelFamily(Enum):
    """Decoder families we implement; they differ only in attention details."""

    LLAMA = "llama"
    QWEN2 = "qwen2"  # q/k/v projections carry a bias
    QWEN3 = "qwen3"  # per-head RMS norm on q and k before rope


_ARCHITECTURES = {
    "LlamaForCausalLM": ModelFamily.LLAMA,
    "LlamaForCausalLMEagle": ModelFamily.LLAMA,  # an EAGLE-1 draft head (model/eagle.py): Llama layers
    "LlamaForCausalLMEagle3": ModelFamily.LLAMA,  # an EAGLE-3 draft head (model/eagle.py): a Llama midlayer
    "Eagle3LlamaForCausalLM": ModelFamily.LLAMA,  # vLLM's name for the same layout
    "MistralForCausalLM": ModelFamily.LLAMA,
    "Qwen2ForCausalLM": ModelFamily.QWEN2,
    "Qwen3ForCausalLM": ModelFamily.QWEN3,
}


class UnsupportedModelError(ValueError):
    """The folder holds a model this build cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of one decoder-only model; everything the model code needs."""

    family: ModelFamily
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    name: str = field(default="", compare=False)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{model_dir}: no config.json")
        return cls.from_dict(json.loads(path.read_text()), name=Path(model_dir).name)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        family = _family(cfg)
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention is not supported")
        heads = cfg["num_attention_heads"]
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=family is ModelFamily.QWEN2 or bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family is ModelFamily.QWEN3,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            rope_scaling=_rope_scaling(cfg),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            name=name,
        )


def _family(cfg: dict[str, Any]) -> ModelFamily:
    for arch in cfg.get("architectures") or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    names = cfg.get("architectures") or cfg.get("model_type")
    raise UnsupportedModelError(f"unsupported architecture {names}; supported: {sorted(_ARCHITECTURES)}")


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The scaling dict of transformers 4 (``rope_scaling``) or 5 (``rope_parameters``), or None."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    return {k: v for k, v in scaling.items() if k != "rope_theta"} | {"rope_type": kind}


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
