"""The campaign's model and prompts: a tiny random Llama that speaks the built-in model's
tokenizer (text in, text out, a chat template, fast on two cores), prompts that share long
prefixes as chat and agent traffic does, and the no-cache reference their outputs must equal."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from faults.load import Outcome, Request, Result, send_all

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
WORDS = ("cache", "prefix", "decode", "page", "token", "router", "tier", "store", "node", "batch", "lease",
         "stream", "model", "layer", "host", "device", "shared", "reuse", "agent", "tool")


def make_model(out_dir: Path, builtin: Path, max_position: int = 4096) -> Path:
    """A 2-layer random Llama (hidden 64) with the built-in model's tokenizer and vocabulary."""
    import torch
    import transformers

    if (out_dir / "config.json").exists():
        return out_dir
    vocab = transformers.AutoConfig.from_pretrained(builtin).vocab_size
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=max_position, initializer_range=0.2,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(builtin / name, out_dir / name)
    return out_dir


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def prompts(count: int, seed: int, prefixes: int = 8, prefix_words: tuple[int, int] = (100, 600)) -> list[str]:
    """``count`` prompts over ``prefixes`` shared system prompts (so the cache is hit across
    requests and tiers), each with its own question of 5-60 words."""
    rng = random.Random(seed)
    shared = [_text(rng, rng.randint(*prefix_words)) for _ in range(prefixes)]
    return [f"{rng.choice(shared)}\nQ{i}: {_text(rng, rng.randint(5, 60))}" for i in range(count)]


def requests(count: int, seed: int, stream_share: float = 0.5) -> list[Request]:
    """Mixed lengths, half of them streaming."""
    rng = random.Random(seed + 1)
    return [Request(p, max_tokens=rng.choice((1, 4, 16, 32)), stream=rng.random() < stream_share)
            for p in prompts(count, seed)]


class Reference:
    """Greedy outputs of a node without prefix cache (``--disable-radix-cache``): what every
    request must produce, whatever tier its prefix came from."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.texts: dict[tuple[str, int], str] = {}

    async def learn(self, wanted: list[Request]) -> None:
        keys = sorted({(r.prompt, r.max_tokens) for r in wanted} - self.texts.keys())
        asked = [Request(prompt, max_tokens) for prompt, max_tokens in keys]
        for outcome in await send_all(self.url, self.model, asked, concurrency=8, timeout_s=600):
            if outcome.result is not Result.OK:
                raise RuntimeError(f"the reference node failed: {outcome.result} {outcome.detail}")
            self.texts[outcome.request.prompt, outcome.request.max_tokens] = outcome.texts[0]

    def wrong(self, outcome: Outcome) -> int:
        """Choices of a successful greedy outcome whose text differs from the reference."""
        if outcome.result is not Result.OK or outcome.request.temperature != 0:
            return 0
        want = self.texts.get((outcome.request.prompt, outcome.request.max_tokens))
        return sum(text != want for text in outcome.texts)

    def describe(self, outcome: Outcome) -> str:
        """Where a wrong outcome's first wrong choice leaves the reference (for the report)."""
        request = outcome.request
        want = self.texts.get((request.prompt, request.max_tokens), "")
        got = next(t for t in outcome.texts if t != want)
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        return (f"wrong output ({'stream' if request.stream else 'plain'}, prompt of {len(request.prompt)} chars "
                f"ending {request.prompt[-30:]!r}, max_tokens {request.max_tokens}): differs at char {at}: "
                f"got {got[at:at + 40]!r}, want {want[at:at + 40]!r}")
