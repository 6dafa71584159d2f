"""Shared pieces of ``benchmarks/tp``: the tiny random model, prompts, node processes, the
rotating order of side-by-side measurements and medians."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # helpers.tiny_models, helpers.processes: the tests' helpers, reused

from helpers.polling import wait_until  # noqa: E402
from helpers.processes import MasterProcess, NodeProcess, stop  # noqa: E402
from helpers.tiny_models import _config, add_word_tokenizer  # noqa: E402

from tierserve.launch import free_port, http_ok  # noqa: E402

VOCAB = 384  # the word tokenizer's: token i is "w<i>"
PAGE = 16
NODE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--page-size", str(PAGE)]
__all__ = ["MasterProcess", "NodeProcess", "free_port", "stop", "wait_until"]


@dataclass(frozen=True)
class ModelShape:
    """The benchmark's tiny Llama: big enough that compute and KV are not all overhead."""

    hidden: int = 512
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 1024
    max_position: int = 4096

    @property
    def token_bytes(self) -> int:
        """K and V of one token, every layer and KV head, float32."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 4


def make_model(out_dir: Path, shape: ModelShape, seed: int = 0) -> Path:
    """A random Llama of ``shape`` with the word tokenizer (as ``tests/helpers/tiny_models.py`` makes its
    models, larger)."""
    import transformers

    torch.manual_seed(seed)
    config = _config("llama", shape.max_position, shape.heads, shape.kv_heads)
    config.hidden_size, config.num_hidden_layers = shape.hidden, shape.layers
    config.intermediate_size, config.head_dim = shape.intermediate, shape.head_dim
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    return add_word_tokenizer(out_dir, VOCAB)


def prompt(tokens: int, seed: int) -> list[int]:
    """Random token ids: each seed a prompt no cache holds yet."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (tokens,), generator=gen).tolist()


class ServeProcess:
    """``tierserve serve --tp-size N`` (rank 0 runs HTTP, the other ranks are its children)."""

    def __init__(self, model: Path, tp_size: int, log: Path, *flags: str) -> None:
        self.port, self.log = free_port(), log
        cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--model", str(model), "--port", str(self.port),
               "--tp-size", str(tp_size), *NODE_FLAGS, "--quiet-access-log", "--log-level", "warning", *flags]
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, deadline_s: float = 180.0) -> ServeProcess:
        wait_until(lambda: http_ok(f"{self.url}/health"), "tierserve serve", deadline_s, self.proc, self.log)
        return self

    def stop(self) -> None:
        stop(self.proc)


def rotated(names: list[str], turn: int) -> list[str]:
    """``names`` starting at ``turn``, reversed every other cycle: none always runs first or after
    another (as ``benchmarks/transfer.py`` orders its rounds)."""
    k = turn % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if (turn // len(names)) % 2 else order


def clock(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def median(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def median_ratio(rounds: list[dict[str, float]], num: str, den: str) -> float:
    """Median of the per-round ratios ``num / den`` (measured side by side in each round)."""
    return statistics.median(r[num] / r[den] for r in rounds)
