"""Settings of one engine (model, device, KV pool, batching, prefix cache). Role-only settings
(the decode role's lease and grace, the prefill role's handoff deadline) live with their role."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from tierserve.cache.options import CacheKind, HiCacheOptions


class CPAttention(Enum):
    """How a CP rank's attention reads the pages other ranks own (docs/architecture.md, Context
    parallelism, merged attention)."""

    MERGE = "merge"  # layer 0 and short steps merge partial attention; layers 1.. of longer steps gather
    GATHER = "gather"  # every layer of every step gathers the prefix pages (the seed's protocol alone)


@dataclass(frozen=True)
class EngineConfig:
    """``max_total_tokens`` sizes the KV pool (default: a fraction of free GPU memory on CUDA,
    16384 tokens on CPU). ``max_model_len`` caps prompt plus output (default: the model's).
    ``disable_radix_cache`` turns off reuse of earlier requests' KV for shared prompt prefixes;
    ``enable_hierarchical_cache`` adds the host-memory tier (L2) behind it. ``tp_size`` x ``pp_size``
    ranks (one process each, on devices from ``base_gpu_id`` on CUDA) share the model: ``pp_size``
    pipeline stages of contiguous layers, each split over ``tp_size`` tensor ranks; every collective
    between them gives up after ``dist_timeout_s`` (docs/architecture.md, Ranks, Pipeline parallelism).
    ``cp_size`` ranks share the KV pages by context parallelism, each storing 1/cp_size of them
    (docs/architecture.md, Context parallelism), also in the host tier and L3; not yet with TP, PP or
    the decode role; ``cp_attention`` says where attention merges instead of gathering.
    ``offload_generated``: running requests hand each page they fill to the prefix cache at once,
    so the hierarchical cache copies it on to L2 and L3 while they run (decode nodes: continuous
    offload, docs/architecture.md, The cache)."""

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
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    cp_attention: CPAttention = CPAttention.MERGE
    base_gpu_id: int = 0
    dist_timeout_s: float = 120.0
    offload_generated: bool = False

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be at least 1")
        if self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be at least 1")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be at least 1")
        self._check_parallel()

    def _check_parallel(self) -> None:
        if self.tp_size < 1:
            raise ValueError("tp_size must be at least 1")
        if self.pp_size < 1:
            raise ValueError("pp_size must be at least 1")
        self._check_context_parallel()
        if self.base_gpu_id < 0:
            raise ValueError("base_gpu_id must not be negative")
        if self.dist_timeout_s <= 0:
            raise ValueError("dist_timeout_s must be positive")
        if self.num_ranks > 1 and ":" in self.device:
            raise ValueError(f"--device {self.device} names one device; with --tp-size use --device cuda "
                             "and --base-gpu-id (one device per rank from there)")

    def _check_context_parallel(self) -> None:
        """What context parallelism does not run with yet, refused before any process starts."""
        if self.cp_size < 1:
            raise ValueError("cp_size must be at least 1")
        if self.cp_size == 1:
            return
        if self.tp_size > 1 or self.pp_size > 1:
            raise ValueError("--cp-size with --tp-size or --pp-size is not supported yet: use one of them")

    @property
    def num_ranks(self) -> int:
        """The node's rank processes: every stage's tensor ranks, or every CP rank's (never both)."""
        return self.tp_size * self.pp_size * self.cp_size

    @property
    def cache_kind(self) -> CacheKind:
        if self.disable_radix_cache:
            return CacheKind.NONE
        return CacheKind.HIERARCHICAL if self.enable_hierarchical_cache else CacheKind.RADIX
