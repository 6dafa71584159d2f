"""A checkpoint's identity for the KV namespace: its config and the bytes of its weights.

KV computed with other weights must never be served, so a retrained checkpoint at the same path
(same file names, same sizes) must get another namespace: the weights are hashed. Hashing reads
every byte once (about 1 GB/s), so each file's digest is cached under the tierserve cache folder,
keyed by the file's path, size and modification time; a later start reads no weights for this.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

from tierserve.model.fetch import cache_root

CHUNK = 8 << 20  # bytes read per hash update


def model_identity(model_dir: Path, cache_dir: Path | None = None) -> str:
    """``name:digest`` of the folder's ``config.json`` and every ``*.safetensors`` file's bytes."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{f.name}:{file_digest(f, cache_dir or default_cache_dir())}".encode())
    return f"{model_dir.name}:{digest.hexdigest()[:16]}"


def file_digest(path: Path, cache_dir: Path) -> str:
    """SHA-256 of the file's bytes, from the cache when the file is unchanged since it was hashed."""
    stat = path.stat()
    stamp = [stat.st_size, stat.st_mtime_ns]
    entry = cache_dir / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]}.json"
    cached = _read(entry)
    if cached.get("stamp") == stamp:
        return cached["sha256"]
    value = _hash(path)
    _write(entry, {"path": str(path.resolve()), "stamp": stamp, "sha256": value})
    return value


def default_cache_dir() -> Path:
    return cache_root() / "weight-digests"


def _hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _read(entry: Path) -> dict:
    try:
        return json.loads(entry.read_text())
    except (OSError, ValueError):
        return {}


def _write(entry: Path, value: dict) -> None:
    """Atomically, and only if it can: a read-only cache just means hashing again next time."""
    with contextlib.suppress(OSError):
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=entry.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(value, tmp)
        os.replace(tmp.name, entry)
