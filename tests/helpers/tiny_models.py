"""Tiny random-weight Hugging Face checkpoints of each supported family, for reference tests."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3")


def _config(family: str, max_position: int = 512, heads: int = 4, kv_heads: int = 2, layers: int = 2,
            vocab_size: int = 384, hidden_size: int = 64):
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_position,
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


def make_tiny_model(family: str, out_dir: Path, seed: int = 0, max_position: int = 512, heads: int = 4,
                    kv_heads: int = 2, layers: int = 2, vocab_size: int = 384, hidden_size: int = 64) -> Path:
    """Saves a random ``family`` model to ``out_dir`` and returns it. Qwen2's q/k/v biases and
    Qwen3's q/k norms get random non-trivial values (their defaults, zero and one, hide bugs).
    ``max_position`` is the model's context length (max_position_embeddings); ``heads`` and
    ``kv_heads`` its attention and KV heads (Llama and Qwen3 keep head_dim 16, Qwen2 has hidden_size / heads);
    ``layers`` its decoder layers, ``vocab_size`` its tokens (ids 0 and 1 are BOS and EOS), ``hidden_size``
    its residual width."""
    import transformers

    torch.manual_seed(seed)
    config = _config(family, max_position, heads, kv_heads, layers, vocab_size, hidden_size)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                param.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight", "layernorm.weight", "norm.weight")):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    return out_dir


def add_word_tokenizer(model_dir: Path, vocab_size: int = 384, byte_level: bool = False) -> Path:
    """Gives a tiny model a tokenizer whose token i is the word ``w<i>``, so an API that answers in
    text answers in token ids too: ``decode`` joins the words with spaces, ``encode`` splits them.
    ``byte_level``: token i is " w<i>" in GPT-2's byte-level alphabet (decoded text starts with a
    space), a vocabulary llguidance can read, so requests with a grammar run on the model; a grammar
    over it must not force bytes that are part of a word (docs/structured.md, ``WORD_REGEX``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    prefix = "\u0120" if byte_level else ""  # "Ġ": the byte-level alphabet's space
    tokenizer = Tokenizer(models.WordLevel({f"{prefix}w{i}": i for i in range(vocab_size)}, unk_token=f"{prefix}w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if byte_level:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [tokenizer.pre_tokenizer, pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)])
        tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


def add_byte_tokenizer(model_dir: Path) -> Path:
    """Gives a tiny model a byte-level tokenizer with no merges: ids 0 and 1 are ``<s>`` and ``</s>``
    (the tiny config's BOS and EOS), id 2 + b the byte b. It spells any text one byte a token, so
    a JSON grammar runs on a tiny model without the built-in model's package (a GPU machine has none)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({"<s>": 0, "</s>": 1} | {c: 2 + i for i, c in enumerate(alphabet)}, []))
    tokenizer.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


# A regex over a byte-level word vocabulary (``add_word_tokenizer(byte_level=True)``): 400 words of
# w2-w99, never complete within a test's tokens (no EOS). llguidance tokenizes the bytes every
# continuation shares ("forced") with the model's tokenizer, which cannot spell " w" alone: the
# alternative "x", which no token spells, leaves nothing forced.
WORD_REGEX = "( w[2-9][0-9]?|x){400}"


def make_noisy_draft(target_dir: Path, out_dir: Path, scale: float, seed: int = 0) -> Path:
    """A draft model for ``target_dir``: its weights plus Gaussian noise of ``scale`` times each
    tensor's standard deviation, so the draft agrees with the target often but not always."""
    import shutil

    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for file in sorted(target_dir.glob("*.safetensors")):
        for name, t in load_file(str(file)).items():
            noise = torch.randn(t.shape, generator=gen) * scale * (t.float().std() if t.numel() > 1 else 0)
            tensors[name] = (t.float() + noise).to(t.dtype)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out_dir / name)
    return out_dir


def make_looping_model(model_dir: Path, out_dir: Path, attention_scale: float = 0.0) -> Path:
    """``model_dir``'s model with its attention outputs (o_proj) scaled by ``attention_scale``: at 0
    each next token depends on the current one alone, so greedy text runs into a cycle that prompt
    lookup (NGRAM speculation) predicts exactly; at a small scale (0.02) it keeps coming back to
    the same runs of tokens, but attention changes enough of them that some drafts are rejected."""
    import shutil

    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors |= {n: t * attention_scale if "o_proj" in n else t for n, t in load_file(str(file)).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out_dir / name)
    return out_dir


def widen_kv_heads(model_dir: Path, factor: int = 2) -> Path:
    """Rewrites a Llama-family model in place with ``factor`` x its KV heads, each KV head repeated
    for the query heads that shared it: the same model (same logits), KV rows of another shape (a
    draft that needs the sidecar layout)."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    kv = config["num_key_value_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            tensors[name] = t.view(kv, dim, *t.shape[1:]).repeat_interleave(factor, dim=0).flatten(0, 1).contiguous()
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    config["num_key_value_heads"] = kv * factor
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


BUILTIN_VOCAB = 49152  # the built-in model's (SmolLM2's) tokenizer


def add_builtin_tokenizer(model_dir: Path, chat_template: str | None = None) -> Path:
    """Gives a tiny model of ``BUILTIN_VOCAB`` tokens the built-in model's tokenizer (real BPE text,
    what grammars and tool parsers need); ``chat_template`` replaces its template."""
    import json
    import shutil

    from tierserve.model.fetch import fetch_builtin_model

    source = fetch_builtin_model(progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, model_dir / name)
    if chat_template is not None:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": chat_template}))
    return model_dir


def make_eagle_target(out_dir: Path, seed: int = 0, layers: int = 1, embed_rms: float = 1.0) -> Path:
    """A tiny llama whose embedding rows have RMS ``embed_rms``, so its first norm only scales them by
    its weight: an EAGLE head can then compute what the target computes (``make_mimic_eagle``; at
    0.01 the embedding is negligible in the residual beside the attention's output, which an EAGLE-3
    head needs: ``make_mimic_eagle3``). Layers after the first add nothing to the residual (their
    output projections are zero), so the model computes what its first layer does, over as many
    pipeline stages as ``layers``."""
    from safetensors.torch import load_file, save_file

    make_tiny_model("llama", out_dir, seed=seed, layers=layers)
    tensors = load_file(str(out_dir / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt() * embed_rms
    for name in [n for n in tensors if n.endswith(("o_proj.weight", "down_proj.weight"))]:
        if not name.startswith("model.layers.0."):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def make_mimic_eagle(target_dir: Path, out_dir: Path, feature_scale: float) -> Path:
    """An EAGLE-1 head for ``make_eagle_target``'s model that recomputes its layer: ``fc`` passes
    the token's embedding plus ``feature_scale`` times the target's feature, the layer is the
    target's with its input norm folded into q/k/v, and its own LM head folds in the target's final
    norm. It sees no slot 0 and adds the scaled feature, so it agrees with the target often, not
    always; and what it drafts depends on its restored rows and on the features it is handed."""
    import json

    from safetensors.torch import load_file, save_file

    from tierserve.model.eagle import write_random_eagle

    write_random_eagle(target_dir, out_dir)
    t = load_file(str(target_dir / "model.safetensors"))
    hidden = t["model.embed_tokens.weight"].shape[1]
    norm_in = t["model.layers.0.input_layernorm.weight"]
    head = {"fc.weight": torch.cat([torch.eye(hidden), feature_scale * torch.eye(hidden)], dim=1),
            "lm_head.weight": t["lm_head.weight"] * t["model.norm.weight"][None, :]}
    for name, tensor in t.items():
        if name.startswith("model.layers.0.") and "input_layernorm" not in name:
            folded = tensor * norm_in[None, :] if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) \
                else tensor
            head[name.removeprefix("model.")] = folded.contiguous()
    save_file(head, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps(config | {"torch_dtype": "float32"}))
    return out_dir


def make_mimic_eagle3(target_dir: Path, out_dir: Path, feature_scale: float, embed_feature: float = 0.0) -> Path:
    """An EAGLE-3 head for ``make_eagle_target(layers=2, embed_rms=0.01)``'s model that recomputes
    its first layer. It reads the inputs of layers 0 (the embedding), 1 and 2 (the last layer's
    output). ``fc`` passes a thousandth of layer 0's output at the position before: the residual,
    negligible beside the attention's output as the target's embedding is. The midlayer's attention reads the token as
    the target's layer does (its input norm, q/k/v) plus ``feature_scale`` times q/k/v of the normed
    feature; its output projection, MLP and norms, the final norm and the LM head are the target's.
    So, like ``make_mimic_eagle``, it agrees with the target often, not always, and with a feature
    scale what it drafts depends on the features it is handed (the captures of the right layers).
    ``embed_feature``: ``fc`` also passes that much of layer 0's input (the embedding at the
    position before, taken on a pipeline's first stage and sent on to the last), so its drafts
    depend on that capture too (at 0.3 some change; the residual stays negligible)."""
    from safetensors.torch import load_file, save_file

    from tierserve.model.eagle import write_random_eagle3

    write_random_eagle3(target_dir, out_dir, capture=(0, 1, 2))
    t = load_file(str(target_dir / "model.safetensors"))
    hidden = t["model.embed_tokens.weight"].shape[1]
    zeros = torch.zeros(hidden, hidden)
    head = load_file(str(out_dir / "model.safetensors"))
    head["fc.weight"] = torch.cat([embed_feature * torch.eye(hidden), 1e-3 * torch.eye(hidden), zeros], dim=1)
    for name, tensor in t.items():
        if not name.startswith("model.layers.0."):
            continue
        ours = "midlayer." + name.removeprefix("model.layers.0.")
        q_k_v = name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))
        head[ours] = torch.cat([tensor, feature_scale * tensor], dim=1) if q_k_v else tensor
    head["norm.weight"] = t["model.norm.weight"]
    save_file(head, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
