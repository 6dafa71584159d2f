"""Flags shared by several commands, each defined once.

The engine's flags are one table (``ENGINE_FLAGS``): each row names a flag and the field of
``EngineConfig`` it sets, so the parser, the config built from parsed flags and the flags
``tierserve up`` forwards to its nodes all come from it. A new engine setting (a parallelism
mode, say) is one row here and one field in the config. Defaults come from the config classes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierserve.cache.options import DraftLayout, HiCacheOptions, HostLayout, IOBackend, PrefetchPolicy, WritePolicy
from tierserve.core.layer_split import layer_partition
from tierserve.core.storage import StorageKind
from tierserve.engine.config import CPAttention, EngineConfig, SchedulePolicy, SpeculativeAlgorithm
from tierserve.tracing.config import TracingConfig, check_endpoint

if TYPE_CHECKING:
    from tierserve.api.tenants import TenantKeys

log = logging.getLogger("tierserve")
_DEFAULTS = EngineConfig(model_dir=Path())  # the config nobody set a flag of: every flag's default
SWITCH = None  # ``Flag.parse`` of an on/off flag (``store_true``)

@dataclass(frozen=True)
class Flag:
    """``name`` sets the config field at dotted ``path`` (``"hicache.ratio"``); ``parse`` turns the
    text into the value (an ``Enum`` class: its members are the choices; ``SWITCH``: no value)."""

    name: str
    path: str
    help: str
    parse: Callable[[str], Any] | None = str


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("--device", "device", "auto, cpu, cuda or cuda:N"),
    Flag("--dtype", "dtype", "auto, bfloat16, float16 or float32"),
    Flag("--page-size", "page_size", "tokens per KV page", int),
    Flag("--max-total-tokens", "max_total_tokens", "KV pool size in tokens", int),
    Flag("--mem-fraction-static", "mem_fraction_static", "GPU memory share for the KV pool", float),
    Flag("--chunked-prefill-size", "chunked_prefill_size", "prompt tokens per step", int),
    Flag("--max-running-requests", "max_running_requests", "requests in the running batch", int),
    Flag("--schedule-policy", "schedule_policy", "the order waiting requests are admitted in: lpm (longest "
         "cached prefix first), fcfs (arrival order) or priority (the request's priority, lower first, then "
         "arrival; less important running requests are preempted for more important ones)", SchedulePolicy),
    Flag("--context-length", "max_model_len", "max prompt + output tokens (default: the model's)", int),
    Flag("--seed", "seed", "random seed", int),
    # Tensor parallelism: one process per rank (docs/tp.md).
    Flag("--tp-size", "tp_size", "tensor-parallel ranks (processes) of this node", int),
    # Pipeline parallelism: stages of contiguous layers, each of --tp-size ranks (docs/pp.md).
    Flag("--pp-size", "pp_size", "pipeline stages of this node (serve, prefill, decode); any layer count: the "
         "default split gives the stages before the last one extra layer each where the size does not divide "
         "them (vLLM's)", int),
    Flag("--pp-layer-partition", "pp_layer_partition", "layers of each pipeline stage, e.g. 11,10,10 (one count "
         "per stage, each at least 1, adding up to the model's layers; as vLLM's VLLM_PP_LAYER_PARTITION)",
         layer_partition),
    # Context parallelism: the KV pages sharded over the ranks (docs/cp.md).
    Flag("--cp-size", "cp_size", "context-parallel ranks (processes): each stores 1/N of the KV pages", int),
    Flag("--cp-attention", "cp_attention", "CP: merge (long steps split their tokens between the ranks, "
         "short steps merge, others merge layer 0 and gather later layers) or gather (every rank computes every "
         "token, every layer gathers)", CPAttention),
    Flag("--base-gpu-id", "base_gpu_id", "CUDA device of rank 0; rank r uses the next r-th", int),
    Flag("--dist-timeout", "dist_timeout_s", "seconds before a collective between ranks gives up", float),
    Flag("--disable-radix-cache", "disable_radix_cache", "do not reuse KV of shared prompt prefixes", SWITCH),
    # The host tier (L2) and L3, named as in SGLang.
    Flag("--enable-hierarchical-cache", "enable_hierarchical_cache", "add a host-memory tier (L2)", SWITCH),
    Flag("--hicache-ratio", "hicache.ratio", "L2 size as a multiple of the device pool", float),
    Flag("--hicache-size", "hicache.size_gb", "L2 size in GB (overrides --hicache-ratio)", float),
    Flag("--hicache-write-policy", "hicache.write_policy", "when L1 pages are copied to L2", WritePolicy),
    Flag("--hicache-write-threshold", "hicache.write_threshold",
         "hits before write_through_selective copies a prefix to L2", int),
    Flag("--hicache-mem-layout", "hicache.mem_layout", "byte order of the L2 pool", HostLayout),
    Flag("--hicache-io-backend", "hicache.io_backend", "how L1 <-> L2 copies run", IOBackend),
    Flag("--hicache-storage-backend", "hicache.storage_backend", "the shared L3 tier", StorageKind),
    Flag("--hicache-storage-backend-extra-config", "hicache.storage_config",
         'backend settings, e.g. {"path": "/cache"}, and prefetch_threshold / prefetch_timeout_*', json.loads),
    Flag("--hicache-storage-prefetch-policy", "hicache.prefetch_policy", "when a request stops waiting for L3",
         PrefetchPolicy),
    # Speculative decoding, named as in SGLang (docs/speculative.md).
    Flag("--speculative-algorithm", "speculative_algorithm", "where drafts come from: STANDALONE (a draft model; "
         "the default with --speculative-draft-model-path), EAGLE (an EAGLE-1 head at --speculative-draft-model-path, "
         "fed the target's hidden states) or NGRAM (prompt lookup in the request's own tokens)",
         SpeculativeAlgorithm),
    Flag("--speculative-draft-model-path", "speculative_draft_model_path",
         "draft model folder (same vocabulary): turns on speculative decoding", Path),
    Flag("--speculative-num-steps", "speculative_num_steps", "draft tokens proposed per step, in a chain "
         "(default 3)", int),
    Flag("--speculative-num-draft-tokens", "speculative_num_draft_tokens",
         "tokens verified per step: the last accepted one plus the drafts (= steps + 1)", int),
    Flag("--speculative-ngram-min-match-window-size", "speculative_ngram_min_match_window_size",
         "NGRAM: the shortest run of last tokens looked up (default 2)", int),
    Flag("--speculative-ngram-max-match-window-size", "speculative_ngram_max_match_window_size",
         "NGRAM: the longest run of last tokens looked up, tried first (default 5)", int),
    Flag("--speculative-ngram-window", "speculative_ngram_window", "NGRAM: the latest tokens of a request "
         "(prompt and output) searched; bounds the matcher's index per request (default 4096)", int),
    Flag("--speculative-draft-layout", "speculative_draft_layout", "where the draft's KV is cached: packed with "
         "the target's pages, a sidecar pool, or auto (packed when the KV rows are shaped alike)", DraftLayout),
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every ``ENGINE_FLAGS`` row, with the config's default."""
    for flag in ENGINE_FLAGS:
        p.add_argument(flag.name, dest=_dest(flag), default=_default(flag.path), help=flag.help, **_kind(flag))


def engine_config(args: argparse.Namespace, model_dir: Path) -> EngineConfig:
    """The engine settings from parsed flags; ``ValueError`` for values out of range."""
    top = {f.path: getattr(args, _dest(f)) for f in ENGINE_FLAGS if "." not in f.path}
    hicache = {f.path.split(".")[1]: getattr(args, _dest(f)) for f in ENGINE_FLAGS if f.path.startswith("hicache.")}
    return EngineConfig(model_dir=model_dir, **top, hicache=HiCacheOptions(**hicache))


def engine_flags(config: EngineConfig) -> list[str]:
    """The command line that gives ``config`` (its non-default settings), e.g. for a child node."""
    out: list[str] = []
    for flag in ENGINE_FLAGS:
        value = _get(config, flag.path)
        if value == _default(flag.path):
            continue
        out += [flag.name] if flag.parse is SWITCH else [flag.name, _text(value)]
    return out


def _dest(flag: Flag) -> str:
    return flag.name.removeprefix("--").replace("-", "_")


def _kind(flag: Flag) -> dict[str, Any]:
    """argparse's options for how a flag reads its value."""
    if flag.parse is SWITCH:
        return {"action": "store_true"}
    if isinstance(flag.parse, type) and issubclass(flag.parse, Enum):
        names = "{" + ",".join(m.value for m in flag.parse) + "}"
        return {"type": flag.parse, "choices": list(flag.parse), "metavar": names}
    return {"type": flag.parse, "metavar": "JSON"} if flag.parse is json.loads else {"type": flag.parse}


def _default(path: str) -> Any:
    return _get(_DEFAULTS, path)


def _get(config: EngineConfig, path: str) -> Any:
    value: Any = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, tuple):  # --pp-layer-partition
        return ",".join(map(str, value))
    return str(value.value if isinstance(value, Enum) else value)


# -- other shared groups ---------------------------------------------------------------------------


def add_listen_args(p: argparse.ArgumentParser, port: int, what: str = "listen") -> None:
    p.add_argument("--host", default="127.0.0.1", help=f"{what} address")
    p.add_argument("--port", type=int, default=port, help=f"{what} port" + (" (0: any free port, logged)"
                                                                            if port == 0 else ""))


def add_model_args(p: argparse.ArgumentParser, served_name: bool = True) -> None:
    p.add_argument("--model", type=Path, help="Hugging Face model folder (default: the built-in model)")
    if served_name:
        p.add_argument("--served-model-name", help="model name in the API (default: the model folder's name)")


TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # api/tool_parsers.py's ToolParserKind values (torch-free names)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """``--chat-template`` and ``--tool-call-parser``: how chat requests and tool calls read (docs/agents.md)."""
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="a Jinja chat template replacing the model's (e.g. one that renders tools)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                   help="the model's tool-call markup: hermes (Qwen2/Qwen3 <tool_call>) or llama3_json "
                        "(default: hermes when the chat template mentions <tool_call>, else llama3_json)")


def chat_flags(args: argparse.Namespace) -> list[str]:
    """``add_chat_args``' flags as given, for a child process (``up``'s router)."""
    template = ["--chat-template", str(args.chat_template.resolve())] if args.chat_template else []
    return template + (["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else [])


def add_tracing_args(p: argparse.ArgumentParser) -> None:
    """``--otlp-traces-endpoint`` (vLLM's and SGLang's name) and ``--otlp-traces-sample-ratio``
    (serve, router, prefill, decode; ``up`` passes them on): docs/tracing.md."""
    p.add_argument("--otlp-traces-endpoint", type=_endpoint, metavar="URL",
                   help="send OpenTelemetry traces (OTLP over gRPC) to this collector, e.g. localhost:4317 or "
                        "https://tempo:4317 (plaintext unless https); default: no tracing, at no cost")
    p.add_argument("--otlp-traces-sample-ratio", type=_ratio, default=1.0, metavar="RATIO",
                   help="share of new traces kept (0-1, default 1); a request with a traceparent follows its caller")


def tracing_config(args: argparse.Namespace) -> TracingConfig:
    return TracingConfig(args.otlp_traces_endpoint, args.otlp_traces_sample_ratio)


def _endpoint(text: str) -> str:
    try:
        return check_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], not {text}")
    return value


def add_api_key_args(p: argparse.ArgumentParser, admin: str) -> None:
    """``--api-key`` or ``--api-keys`` on the API routes and ``--admin-api-key`` enabling ``admin``."""
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on the API routes (one tenant)")
    keys.add_argument("--api-keys", type=Path, metavar="FILE",
                      help='tenants: JSON {"keys": {"<key>": {"tenant": "<name>", "max_concurrent": n, '
                           '"requests_per_minute": n, "deadline_ms": n}}} (limits and the default first-token '
                           'deadline optional); the tenant decides the cache namespace')
    p.add_argument("--admin-api-key", help=f"enable {admin} with this key (never a tenant's key)")


def add_admission_args(p: argparse.ArgumentParser) -> None:
    """``--admission`` (``serve``, ``router``, ``up``): what a request's first-token deadline does."""
    from tierserve.api.admission import AdmissionPolicy

    p.add_argument("--admission", type=AdmissionPolicy, choices=list(AdmissionPolicy), default=AdmissionPolicy.TTFT,
                   metavar="{" + ",".join(a.value for a in AdmissionPolicy) + "}",
                   help="ttft: a request whose predicted time to first token is past its deadline "
                        "(x-request-deadline-ms, or its API key's deadline_ms) gets 429 with Retry-After at once; "
                        "fcfs: every request is queued in arrival order, late first tokens only counted")


def tenant_keys(args: argparse.Namespace) -> TenantKeys | None:
    """The API keys of ``--api-key`` or ``--api-keys`` (``None``: the API is open); ``ValueError``
    for a bad key file or an admin key that is also a tenant's."""
    from tierserve.api.auth import check_admin_key
    from tierserve.api.tenants import TenantKeys

    keys = TenantKeys.load(args.api_keys) if args.api_keys else TenantKeys.single(args.api_key) if args.api_key \
        else None
    check_admin_key(args.admin_api_key, keys)
    return keys


def model_dir(args: argparse.Namespace) -> Path | None:
    """``--model`` or the built-in model (converted once); None, with the reason printed, when the
    folder is not a model folder."""
    folder = args.model or builtin_model()
    if not (folder / "config.json").is_file():
        print(f"tierserve: {folder} is not a model folder (no config.json)", file=sys.stderr)
        return None
    return folder


def node_engine_config(args: argparse.Namespace) -> EngineConfig | None:
    """The engine settings of a command that runs an engine; None, with the reason printed, for a
    missing model folder or a flag out of range (a usage error, not a crash)."""
    folder = model_dir(args)
    if folder is None:
        return None
    try:
        return engine_config(args, folder)
    except ValueError as exc:
        print(f"tierserve: {exc}", file=sys.stderr)
        return None


def builtin_model() -> Path:
    from tierserve.model.fetch import builtin_model_dir, fetch_builtin_model, is_complete

    if not is_complete(builtin_model_dir()):
        log.info("converting the built-in model (once)")
    return fetch_builtin_model(progress=True)
