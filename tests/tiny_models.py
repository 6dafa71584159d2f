"""Tiny random-weight Hugging Face checkpoints of each supported family, for reference tests."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3")


def _config(family: str, max_position: int = 512):
    import transformers

    common = dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position,
        initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1,
    )
    if family == "llama":
        return transformers.LlamaConfig(**common, head_dim=16)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16, use_sliding_window=False)
    raise ValueError(family)


def make_tiny_model(family: str, out_dir: Path, seed: int = 0, max_position: int = 512) -> Path:
    """Saves a random ``family`` model to ``out_dir`` and returns it. Qwen2's q/k/v biases and
    Qwen3's q/k norms get random non-trivial values (their defaults, zero and one, hide bugs).
    ``max_position`` is the model's context length (max_position_embeddings)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, max_position), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                param.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight", "layernorm.weight", "norm.weight")):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    return out_dir
