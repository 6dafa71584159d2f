"""Flags become typed engine settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierserve.cache.options import HostLayout, IOBackend, PrefetchPolicy, WritePolicy
from tierserve.cli.flags import engine_config
from tierserve.cli.main import build_parser


def test_hicache_flags_reach_the_engine_config() -> None:
    args = build_parser().parse_args([
        "serve", "--page-size", "64", "--enable-hierarchical-cache", "--hicache-ratio", "3",
        "--hicache-write-policy", "write_back", "--hicache-mem-layout", "layer_first",
        "--hicache-io-backend", "direct", "--chunked-prefill-size", "512",
        "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", '{"path": "/l3"}',
        "--hicache-storage-prefetch-policy", "timeout",
    ])
    cfg = engine_config(args, Path("/m"))
    assert cfg.page_size == 64 and cfg.chunked_prefill_size == 512 and cfg.enable_hierarchical_cache
    assert cfg.hicache.ratio == 3.0 and cfg.hicache.write_policy is WritePolicy.WRITE_BACK
    assert cfg.hicache.mem_layout is HostLayout.LAYER_FIRST and cfg.hicache.io_backend is IOBackend.DIRECT
    assert cfg.hicache.storage_backend == "file" and cfg.hicache.storage_config == {"path": "/l3"}
    assert cfg.hicache.prefetch_policy is PrefetchPolicy.TIMEOUT


def test_unknown_policy_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--hicache-write-policy", "sometimes"])
