"""L3 in a directory: one file per page key, atomic writes, a size quota with LRU deletion."""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from tierserve.cache.storage.base import StorageBackend


class FileStorage(StorageBackend):
    """Pages as files under ``directory`` (shared by processes that mount it).

    A write lands under a temporary name and is renamed into place, so readers never see half a
    page. ``quota_bytes`` bounds the directory: the least recently used pages this process knows
    of are deleted first (the index starts from the files' modification times).
    """

    def __init__(self, directory: str | Path, quota_bytes: int | None = None) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.quota = quota_bytes
        self._index: OrderedDict[str, int] = OrderedDict()
        files = sorted(self.dir.glob("*.kv"), key=lambda p: p.stat().st_mtime)
        for path in files:
            self._index[path.stem] = path.stat().st_size
        self._bytes = sum(self._index.values())
        self.hits = self.misses = self.writes = 0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FileStorage:
        if "path" not in config:
            raise ValueError('the file storage backend needs {"path": DIR} in the extra config')
        quota = config.get("quota_gb")
        return cls(config["path"], int(float(quota) * 2**30) if quota is not None else None)

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.kv"

    def batch_exists(self, keys: list[bytes]) -> int:
        for i, key in enumerate(keys):
            if not self._path(key).exists():
                return i
        return len(keys)

    def batch_get_into(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        return [self._read_into(k, s) for k, s in zip(keys, spans, strict=True)]

    def _read_into(self, key: bytes, span: torch.Tensor) -> bool:
        target = span.view(torch.uint8).numpy()
        try:
            with open(self._path(key), "rb") as f:
                ok = f.readinto(memoryview(target)) == target.nbytes
        except FileNotFoundError:
            ok = False
        self.hits += ok
        self.misses += not ok
        if ok and key.hex() in self._index:
            self._index.move_to_end(key.hex())
        return ok

    def batch_set_from(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        return [self._write(k, memoryview(s.view(torch.uint8).numpy())) for k, s in zip(keys, spans, strict=True)]

    def get(self, key: bytes) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def set(self, key: bytes, data: bytes) -> bool:
        return self._write(key, memoryview(data))

    def _write(self, key: bytes, data: memoryview) -> bool:
        path = self._path(key)
        if path.exists():
            return True
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            return False
        self._index[key.hex()] = data.nbytes
        self._bytes += data.nbytes
        self.writes += 1
        self._enforce_quota()
        return True

    def _enforce_quota(self) -> None:
        while self.quota is not None and self._bytes > self.quota and self._index:
            name, size = self._index.popitem(last=False)
            (self.dir / f"{name}.kv").unlink(missing_ok=True)
            self._bytes -= size

    def clear(self) -> None:
        for path in self.dir.glob("*.kv"):
            path.unlink(missing_ok=True)
        self._index.clear()
        self._bytes = 0

    def stats(self) -> dict[str, Any]:
        return {"backend": "file", "path": str(self.dir), "pages": len(self._index), "bytes": self._bytes,
                "hits": self.hits, "misses": self.misses, "writes": self.writes}
