"""Settings of one engine (model, device, KV pool, batching, prefix cache). Role-only settings
(the decode role's lease and grace, the prefill role's handoff deadline) live with their role."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from tierserve.cache.options import CacheKind, DraftLayout, HiCacheOptions
from tierserve.core.layer_split import PipelineParallelError, check_partition

DEFAULT_SPEC_STEPS = 3
DEFAULT_NGRAM_MIN, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_WINDOW = 2, 5, 4096


class SpeculativeAlgorithm(Enum):
    """Where draft tokens come from (SGLang's ``--speculative-algorithm`` names; docs/speculative.md)."""

    STANDALONE = "STANDALONE"  # a draft model (``speculative_draft_model_path``)
    NGRAM = "NGRAM"  # prompt lookup: the request's own earlier tokens, no second model
    EAGLE = "EAGLE"  # a draft head fed with the target's hidden states (``speculative_draft_model_path``)

    @classmethod
    def _missing_(cls, value: object) -> SpeculativeAlgorithm | None:
        """Names in any case (``ngram``), as users type them."""
        return next((m for m in cls if isinstance(value, str) and m.value == value.upper()), None)


class CPAttention(Enum):
    """How a CP rank's attention reads the pages other ranks own (docs/cp.md, merged attention)."""

    MERGE = "merge"  # long steps split their tokens; short steps merge; else layer 0 merges, layers 1.. gather
    GATHER = "gather"  # every rank computes every token, every layer gathers (the seed's protocol alone)


class SchedulePolicy(Enum):
    """The order waiting requests are admitted in (``Scheduler._order``; SGLang's names)."""

    LPM = "lpm"  # longest cached prefix first (in-flight shared pages included): requests that share go together
    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # the request's priority (lower first, vLLM's), then arrival; preempts less important work


@dataclass(frozen=True)
class EngineConfig:
    """``max_total_tokens`` sizes the KV pool (default: a fraction of free GPU memory on CUDA,
    16384 tokens on CPU). ``max_model_len`` caps prompt plus output (default: the model's).
    ``disable_radix_cache`` turns off reuse of earlier requests' KV for shared prompt prefixes;
    ``enable_hierarchical_cache`` adds the host-memory tier (L2) behind it. ``tp_size`` x ``cp_size`` x
    ``pp_size`` ranks (one process each, on devices from ``base_gpu_id`` on CUDA) share the model: ``pp_size``
    pipeline stages of contiguous layers, each split over ``tp_size`` tensor ranks; every collective
    between them gives up after ``dist_timeout_s`` (docs/ranks.md, docs/pp.md). ``pp_layer_partition``:
    each stage's layer count (None: vLLM's default split, ``default_split``; its sum is checked against
    the model by ``misfit`` before any process starts).
    ``cp_size`` ranks share the KV pages by context parallelism, each storing 1/cp_size of them
    (docs/cp.md), also in the host tier and L3; each CP rank is a whole TP x PP replica of its own
    processes (docs/cp.md, composed with TP and PP), on every role;
    ``cp_attention`` says where attention merges instead of gathering.
    ``speculative_draft_model_path`` turns on speculative decoding with that draft
    model (docs/speculative.md): ``speculative_num_steps`` draft tokens are
    proposed in a chain and verified as ``speculative_num_draft_tokens`` = steps + 1 tokens per step
    (SGLang's meaning with topk 1; give either, default 3 steps); not with TP, PP or CP.
    ``speculative_draft_layout`` says where the draft's KV is cached (``DraftLayout``).
    ``speculative_algorithm``: ``STANDALONE`` (the default when a draft model is given), ``EAGLE`` (the
    draft model path is an EAGLE-1 head fed with the target's hidden states) or ``NGRAM``
    (prompt lookup, no draft model: the latest earlier occurrence of the request's last
    ``speculative_ngram_max_match_window_size`` down to ``..._min_...`` tokens, searched in its latest
    ``speculative_ngram_window`` tokens, proposes the tokens that followed it).
    ``offload_generated``: running requests hand each page they fill to the prefix cache at once,
    so the hierarchical cache copies it on to L2 and L3 while they run (decode nodes: continuous
    offload, docs/cache.md). ``schedule_policy``: the order waiting requests are admitted in
    (``SchedulePolicy``)."""

    model_dir: Path
    device: str = "auto"
    dtype: str = "auto"
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    chunked_prefill_size: int = 2048
    max_running_requests: int = 256
    schedule_policy: SchedulePolicy = SchedulePolicy.LPM
    max_model_len: int | None = None
    seed: int = 0
    disable_radix_cache: bool = False
    enable_hierarchical_cache: bool = False
    hicache: HiCacheOptions = field(default_factory=HiCacheOptions)
    tp_size: int = 1
    pp_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    cp_size: int = 1
    cp_attention: CPAttention = CPAttention.MERGE
    base_gpu_id: int = 0
    dist_timeout_s: float = 120.0
    speculative_draft_model_path: Path | None = None
    speculative_num_steps: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_draft_layout: DraftLayout = DraftLayout.AUTO
    speculative_algorithm: SpeculativeAlgorithm | None = None
    speculative_ngram_min_match_window_size: int | None = None
    speculative_ngram_max_match_window_size: int | None = None
    speculative_ngram_window: int | None = None
    offload_generated: bool = False

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be at least 1")
        if self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be at least 1")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be at least 1")
        self._check_parallel()
        self._check_speculative()

    def _check_speculative(self) -> None:
        """Flags that need an algorithm (or another one) and step counts that disagree (every algorithm
        runs at any rank layout of ``serve``: docs/speculative.md, layouts)."""
        algorithm, steps, tokens = self.spec_algorithm, self.speculative_num_steps, self.speculative_num_draft_tokens
        self._check_algorithm()
        if algorithm is None:
            if steps is not None or tokens is not None:
                raise ValueError("--speculative-num-steps/--speculative-num-draft-tokens need "
                                 "--speculative-draft-model-path or --speculative-algorithm NGRAM")
            return
        if (steps is not None and steps < 1) or (tokens is not None and tokens < 2):
            raise ValueError("speculative decoding needs at least 1 step (2 draft tokens, the first being "
                             "the last accepted token)")
        if steps is not None and tokens is not None and tokens != steps + 1:
            raise ValueError(f"drafts are a chain (topk 1): --speculative-num-draft-tokens must be "
                             f"--speculative-num-steps + 1, not {tokens} with {steps} steps")

    def _check_algorithm(self) -> None:
        """A draft model exactly for STANDALONE; the n-gram settings only for NGRAM, and in range."""
        algorithm, draft = self.spec_algorithm, self.speculative_draft_model_path
        if algorithm in (SpeculativeAlgorithm.STANDALONE, SpeculativeAlgorithm.EAGLE) and draft is None:
            raise ValueError(f"--speculative-algorithm {algorithm.value} needs --speculative-draft-model-path")
        if algorithm is SpeculativeAlgorithm.NGRAM and draft is not None:
            raise ValueError("--speculative-algorithm NGRAM drafts from the request's own tokens: it takes no "
                             "--speculative-draft-model-path")
        ngram = (self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size,
                 self.speculative_ngram_window)
        if algorithm is not SpeculativeAlgorithm.NGRAM:
            if any(v is not None for v in ngram):
                raise ValueError("--speculative-ngram-* flags need --speculative-algorithm NGRAM")
            return
        low, high, window = self.ngram_sizes
        if not 1 <= low <= high:
            raise ValueError(f"--speculative-ngram-min-match-window-size ({low}) must be at least 1 and at most "
                             f"--speculative-ngram-max-match-window-size ({high})")
        if window <= high:
            raise ValueError(f"--speculative-ngram-window ({window}) must exceed "
                             f"--speculative-ngram-max-match-window-size ({high})")

    @property
    def spec_algorithm(self) -> SpeculativeAlgorithm | None:
        """The speculative algorithm: as given, else STANDALONE when a draft model is given; None: off."""
        if self.speculative_algorithm is not None:
            return self.speculative_algorithm
        return SpeculativeAlgorithm.STANDALONE if self.speculative_draft_model_path is not None else None

    @property
    def ngram_sizes(self) -> tuple[int, int, int]:
        """NGRAM's (shortest match, longest match, window) with the defaults filled in."""
        low, high, window = (self.speculative_ngram_min_match_window_size,
                             self.speculative_ngram_max_match_window_size, self.speculative_ngram_window)
        high = DEFAULT_NGRAM_MAX if high is None else high
        low = min(DEFAULT_NGRAM_MIN, high) if low is None else low  # a longest match below the default: it alone
        return low, high, DEFAULT_NGRAM_WINDOW if window is None else window

    @property
    def spec_steps(self) -> int:
        """Draft tokens proposed per step; 0 without speculation."""
        if self.spec_algorithm is None:
            return 0
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        tokens = self.speculative_num_draft_tokens
        return tokens - 1 if tokens is not None else DEFAULT_SPEC_STEPS

    def _check_parallel(self) -> None:
        if self.tp_size < 1:
            raise ValueError("tp_size must be at least 1")
        if self.pp_size < 1:
            raise ValueError("pp_size must be at least 1")
        if self.pp_layer_partition is not None:
            try:
                check_partition(self.pp_layer_partition, self.pp_size)
            except PipelineParallelError as exc:
                raise ValueError(f"--pp-layer-partition: {exc}") from None
        self._check_context_parallel()
        if self.base_gpu_id < 0:
            raise ValueError("base_gpu_id must not be negative")
        if self.dist_timeout_s <= 0:
            raise ValueError("dist_timeout_s must be positive")
        if self.num_ranks > 1 and ":" in self.device:
            raise ValueError(f"--device {self.device} names one device; with --tp-size use --device cuda "
                             "and --base-gpu-id (one device per rank from there)")

    def _check_context_parallel(self) -> None:
        """A CP size below 1, refused before any process starts (any TP x CP x PP the model fits runs,
        on every role)."""
        if self.cp_size < 1:
            raise ValueError("cp_size must be at least 1")

    @property
    def layout_flags(self) -> str:
        """The TP and PP flags as given, for messages: '--tp-size 1 --pp-size 2 --pp-layer-partition 2,1'."""
        pp = f" --pp-size {self.pp_size}" if self.pp_size > 1 else ""
        partition = self.pp_layer_partition
        return f"--tp-size {self.tp_size}{pp}" + (f" --pp-layer-partition {','.join(map(str, partition))}"
                                                  if partition is not None else "")

    @property
    def num_ranks(self) -> int:
        """The node's rank processes: every stage's tensor ranks of every CP rank (docs/ranks.md)."""
        return self.tp_size * self.pp_size * self.cp_size

    @property
    def cache_kind(self) -> CacheKind:
        if self.disable_radix_cache:
            return CacheKind.NONE
        return CacheKind.HIERARCHICAL if self.enable_hierarchical_cache else CacheKind.RADIX
