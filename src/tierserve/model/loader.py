"""Builds a model from a Hugging Face folder and loads its safetensors weights."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tierserve.core.model_config import ModelConfig
from tierserve.model.layers import copy_whole
from tierserve.model.llama import CausalLM
from tierserve.model.parallel import TensorParallel
from tierserve.model.pipeline import SOLE, PipelineStage

# checkpoint sub-name -> (our parameter sub-name, shard id of a stacked parameter)
_STACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_SKIPPED = re.compile(r"rotary_emb\.inv_freq$")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` means the checkpoint's dtype on CUDA, and on a CPU the checkpoint's dtype only if
    the CPU computes in it natively (AVX-512 BF16 / AMX); else float32, which is faster there."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    wanted = DTYPES.get(cfg.torch_dtype, torch.float32)
    if device.type == "cuda":
        return wanted
    native_bf16 = torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")
    return wanted if wanted is torch.bfloat16 and native_bf16 else torch.float32


def checkpoint_tensors(model_dir: Path, keep: Callable[[str], bool] | None = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of every tensor of ``model_dir``'s safetensors files, or of those whose
    name ``keep`` accepts (the others are not read)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)


def parameter_target(name: str) -> tuple[str, object]:
    """Our parameter name and shard id for a checkpoint tensor name."""
    name = name.removeprefix("model.") if not name.startswith("lm_head") else name
    for src, (dst, shard) in _STACKED.items():
        if f".{src}." in name:
            return name.replace(src, dst), shard
    return name, None


def load_weights(model: CausalLM, model_dir: Path) -> None:
    """Copies every checkpoint tensor into its parameter; fails if a parameter stays unloaded."""
    params = dict(model.named_parameters())
    loaded: dict[str, set[object]] = {}
    for ckpt_name, tensor in checkpoint_tensors(model_dir):
        if _SKIPPED.search(ckpt_name):
            continue
        name, shard = parameter_target(ckpt_name)
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied embeddings: some checkpoints store the copy anyway
        if name not in params and model.elsewhere(name):
            continue  # another pipeline stage's layer, embedding or head
        if name not in params:
            raise ValueError(f"{model_dir}: unexpected checkpoint tensor {ckpt_name}")
        param = params[name]
        loader = getattr(param, "weight_loader", copy_whole)
        loader(param, tensor.to(param.dtype), shard)
        loaded.setdefault(name, set()).add(shard)
    missing = sorted(n for n, p in params.items() if len(loaded.get(n, ())) < getattr(p, "num_shards", 1))
    model.weights_changed()
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")


def load_model(
    model_dir: str | Path, device: torch.device, dtype: torch.dtype, tp: TensorParallel | None = None,
    pp: PipelineStage = SOLE,
) -> CausalLM:
    """The model of ``model_dir`` on ``device`` in ``dtype``, weights loaded, in eval mode: the
    shard of tensor rank ``tp`` in pipeline stage ``pp`` (default: all of it)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg, tp or TensorParallel(), pp)
    finally:
        torch.set_default_dtype(previous)
    load_weights(model, model_dir)
    return model.eval().requires_grad_(False)
