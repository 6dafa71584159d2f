"""Settings of one engine (model, device, KV pool, batching)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineConfig:
    """``max_total_tokens`` sizes the KV pool (default: a fraction of free GPU memory on CUDA,
    16384 tokens on CPU). ``max_model_len`` caps prompt plus output (default: the model's).
    ``disable_radix_cache`` turns off reuse of earlier requests' KV for shared prompt prefixes."""

    model_dir: Path
    device: str = "auto"
    dtype: str = "auto"
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    chunked_prefill_size: int = 2048
    max_running_requests: int = 256
    max_model_len: int | None = None
    seed: int = 0
    disable_radix_cache: bool = False

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be at least 1")
        if self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be at least 1")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be at least 1")
