"""L3 in a directory: one file per page key, atomic writes, a size quota with LRU deletion; each
file ends with the XXH3-128 trailer of its name and bytes (``cache/storage/integrity.py``)."""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from tierserve.cache.storage.base import StorageBackend
from tierserve.cache.storage.integrity import DIGEST_BYTES, bytes_digest, page_digest


class FileStorage(StorageBackend):
    """Pages as files under ``directory`` (shared by processes that mount it).

    A write lands under a temporary name and is renamed into place, so readers never see half a
    page. ``quota_bytes`` bounds the directory: the least recently used pages this process knows
    of are deleted first (the index starts from the files' modification times). With ``integrity``
    (the default) a file is its page then a 16-byte trailer, checked on every read as in Mooncake: a
    file of another size or digest (flipped, truncated, another key's, another layout's, written
    before trailers) is a miss, counted in ``integrity_failures``, and deleted.
    """

    def __init__(self, directory: str | Path, quota_bytes: int | None = None, integrity: bool = True) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.quota = quota_bytes
        self._index: OrderedDict[str, int] = OrderedDict()
        files = sorted(self.dir.glob("*.kv"), key=lambda p: p.stat().st_mtime)
        for path in files:
            self._index[path.stem] = path.stat().st_size
        self._bytes = sum(self._index.values())
        self.hits = self.misses = self.writes = 0
        self.integrity, self.integrity_failures = integrity, 0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FileStorage:
        if "path" not in config:
            raise ValueError('the file storage backend needs {"path": DIR} in the extra config')
        quota = config.get("quota_gb")
        return cls(config["path"], int(float(quota) * 2**30) if quota is not None else None,
                   bool(config.get("integrity", True)))

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
                trailer = f.read(DIGEST_BYTES + 1) if self.integrity else b""  # one more: a longer file fails
        except FileNotFoundError:
            ok, trailer = False, None
        if self.integrity and trailer is not None:
            ok = self._accepted(key, ok and trailer == page_digest(key.hex().encode(), span))
        self.hits += ok
        self.misses += not ok
        if ok and key.hex() in self._index:
            self._index.move_to_end(key.hex())
        return ok

    def _accepted(self, key: bytes, intact: bool) -> bool:
        """A present file that failed its check is counted and deleted (the next backup rewrites it)."""
        if not intact:
            self.integrity_failures += 1
            self._path(key).unlink(missing_ok=True)
            self._bytes -= self._index.pop(key.hex(), 0)
        return intact

    def batch_set_from(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        return [self._write(k, memoryview(s.view(torch.uint8).numpy()), self._trailer(k, s))
                for k, s in zip(keys, spans, strict=True)]

    def _trailer(self, key: bytes, page: torch.Tensor | bytes) -> bytes:
        if not self.integrity:
            return b""
        name = key.hex().encode()
        return page_digest(name, page) if isinstance(page, torch.Tensor) else bytes_digest(name, page)

    def get(self, key: bytes) -> bytes | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        if not self.integrity:
            return data
        body, trailer = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
        return body if self._accepted(key, len(data) >= DIGEST_BYTES and self._trailer(key, body) == trailer) else None

    def set(self, key: bytes, data: bytes) -> bool:
        return self._write(key, memoryview(data), self._trailer(key, data))

    def _write(self, key: bytes, data: memoryview, trailer: bytes = b"") -> bool:
        path = self._path(key)
        if path.exists():
            return True
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.write(trailer)
            os.replace(tmp, path)
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            return False
        self._index[key.hex()] = data.nbytes + len(trailer)
        self._bytes += data.nbytes + len(trailer)
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
                "hits": self.hits, "misses": self.misses, "writes": self.writes,
                "integrity_failures": self.integrity_failures}
