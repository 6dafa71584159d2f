"""Shared fixtures: tiny models per family, the built-in model, a mooncake_master per test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from cluster import MasterProcess
from tiny_models import FAMILIES, make_tiny_model


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_model(request, tmp_path_factory) -> Path:
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def builtin_model() -> Path:
    from tierserve.model.fetch import fetch_builtin_model

    return fetch_builtin_model(progress=False)


@pytest.fixture(scope="session")
def long_llama(tmp_path_factory) -> Path:
    """A tiny llama with a 2048-token context, for prompts longer than several prefill chunks."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("long_llama"), max_position=2048)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    """A real ``mooncake_master`` per test: segments of a node stopped by another test must not
    receive objects."""
    master = MasterProcess(tmp_path / "master.log").start()
    yield master
    master.kill()
