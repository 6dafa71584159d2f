"""The model part of the KV namespace: the weights' bytes, not only their sizes, and hashed once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tierserve.model import identity


def test_a_retrained_checkpoint_at_the_same_path_gets_another_identity(tiny_llama: Path, tmp_path: Path) -> None:
    model, cache = tmp_path / "model", tmp_path / "digests"
    shutil.copytree(tiny_llama, model)
    before = identity.model_identity(model, cache)
    weights = next(model.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the same size, the same name, other weights
    weights.write_bytes(bytes(data))
    assert identity.model_identity(model, cache) != before
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert identity.model_identity(model, cache) == before


def test_an_unchanged_file_is_hashed_once(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "digests"
    first = identity.model_identity(tiny_llama, cache)
    monkeypatch.setattr(identity, "_hash", lambda path: pytest.fail(f"{path} was read again"))
    assert identity.model_identity(tiny_llama, cache) == first


def test_a_read_only_cache_only_costs_a_rehash(tiny_llama: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert identity.model_identity(tiny_llama, blocked / "digests") == identity.model_identity(tiny_llama, tmp_path)
