"""Settings of one engine (model, device, KV pool, batching)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierserve.cache.options import HostLayout, IOBackend, PrefetchPolicy, WritePolicy


@dataclass(frozen=True)
class HiCacheOptions:
    """The host tier: ``ratio`` x the device pool, or ``size_gb`` when given (``--hicache-*``), and
    the optional L3 ``storage_backend`` (file, mooncake, dynamic) configured by ``storage_config`` (the
    extra-config JSON; it also overrides the prefetch threshold and timeouts)."""

    ratio: float = 2.0
    size_gb: float | None = None
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_threshold: int = 2
    mem_layout: HostLayout = HostLayout.PAGE_FIRST_DIRECT
    io_backend: IOBackend = IOBackend.KERNEL
    storage_backend: str | None = None
    storage_config: dict[str, Any] = field(default_factory=dict)
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT


@dataclass(frozen=True)
class EngineConfig:
    """``max_total_tokens`` sizes the KV pool (default: a fraction of free GPU memory on CUDA,
    16384 tokens on CPU). ``max_model_len`` caps prompt plus output (default: the model's).
    ``disable_radix_cache`` turns off reuse of earlier requests' KV for shared prompt prefixes;
    ``enable_hierarchical_cache`` adds the host-memory tier (L2) behind it."""

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
    enable_hierarchical_cache: bool = False
    hicache: HiCacheOptions = field(default_factory=HiCacheOptions)
    # decode role: pages a reservation adds beyond the prompt for the first answer tokens, and how
    # long pages a prefill node may still be writing stay unused (longer than any transfer deadline)
    reserve_decode_tokens: int = 256
    reservation_grace_s: float = 40.0

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be at least 1")
        if self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be at least 1")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be at least 1")
