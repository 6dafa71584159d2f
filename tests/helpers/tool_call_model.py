"""A tiny Qwen3 whose greedy reply to any chat is one Hermes tool call (docs/agents.md): a real Qwen3
checkpoint (random attention and MLP weights, as ``make_tiny_model`` makes them) with a local tokenizer
and weights chosen so that the next token depends only on the last one, through a successor map.

Every layer's attention ``o_proj`` and MLP ``down_proj`` are zero, so the residual stream is the input
token's embedding; token t's embedding is the one-hot e_t (hidden size >= vocabulary), and ``lm_head``
row ``succ(t)`` holds a 1 at column t, so the argmax after t is ``succ(t)`` on any engine that runs
Qwen3 correctly. The chat template's generation prompt ends with "\\n", whose successor opens the
markup; the markup's pieces are added tokens, each used once, so the chain ends at ``<|im_end|>``."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

from helpers.tiny_models import make_tiny_model

SPECIALS = ("<|endoftext|>", "<|im_end|>", "<|im_start|>")  # ids 0, 1 (EOS), 2: Qwen's own names
# The reply, one added token per piece (each piece once: a token has one successor). Like Qwen's,
# <tool_call> and </tool_call> are added tokens that are not special, so decoding keeps them.
CALL_PIECES = ("<tool_call>", '\n{"name": "', "get_weather", '", "arguments": {"', "city", '": "', "Paris",
               '"}}\n', "</tool_call>")
CHARS = (*(chr(c) for c in range(32, 127)), "\n")  # everything else: one token per character
CALL_TEXT = "".join(CALL_PIECES)
HIDDEN = 128  # >= the vocabulary: 3 specials + 96 characters + 9 pieces


def make_tool_call_qwen3(out_dir: Path) -> Path:
    """Saves the model and its tokenizer to ``out_dir`` (returned): greedy decoding after a prompt
    that ends with "\\n" spells ``CALL_TEXT`` then ``<|im_end|>`` (its EOS). ``expected_reply`` gives
    the token ids."""
    vocab = _write_tokenizer(out_dir)
    make_tiny_model("qwen3", out_dir, max_position=2048, vocab_size=HIDDEN, hidden_size=HIDDEN)  # EOS: id 1
    _choose_weights(out_dir, vocab)
    return out_dir


def expected_reply(out_dir: Path) -> list[int]:
    """The ids greedy decoding produces after a prompt that ends with "\\n": the call, then EOS."""
    vocab = _vocab(out_dir)
    return [vocab[p] for p in CALL_PIECES] + [vocab["<|im_end|>"]]


def _write_tokenizer(out_dir: Path) -> dict[str, int]:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    out_dir.mkdir(parents=True, exist_ok=True)
    base = {t: i for i, t in enumerate(SPECIALS + CHARS)}  # the added pieces follow, from id 99
    tokenizer = Tokenizer(models.WordLevel(base, unk_token=" "))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")
    tokenizer.decoder = decoders.Fuse()  # characters join without spaces
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    tokenizer.add_tokens([AddedToken(p, normalized=False, special=False) for p in CALL_PIECES])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
              "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.get_vocab(with_added_tokens=True)


def _vocab(out_dir: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(out_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)


def _choose_weights(out_dir: Path, vocab: dict[str, int]) -> None:
    from safetensors.torch import load_file, save_file

    path = out_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(t)
    tensors["model.embed_tokens.weight"] = torch.eye(HIDDEN)
    chain = ["\n", *CALL_PIECES, "<|im_end|>"]
    head = torch.zeros(HIDDEN, HIDDEN)
    for token, succ in itertools.pairwise(chain):
        head[vocab[succ], vocab[token]] = 1.0
    tensors["lm_head.weight"] = head
    save_file(tensors, str(path), metadata={"format": "pt"})
