"""The L3 interface (``docs/cache.md``) and the backend registry."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from tierserve.core.storage import StorageKind


class StorageError(RuntimeError):
    """The backend failed (unreachable, timed out); callers degrade to L1 + L2."""


class StorageBackend(ABC):
    """Objects named by page keys (bytes); each object is one host page's contiguous span.

    Batch calls take parallel lists. ``batch_get_into`` fills the given tensors in place and
    ``batch_set_from`` reads them; both return per-page success, and a page already stored counts
    as a success of ``batch_set_from`` (pages are immutable under their key).
    ``put_skips_existing``: storing a page that exists is a cheap no-op in this backend, so
    backups need not ask ``batch_exists`` first.
    """

    put_skips_existing = False

    @abstractmethod
    def batch_exists(self, keys: list[bytes]) -> int:
        """How many leading keys are present."""

    @abstractmethod
    def batch_get_into(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]: ...

    @abstractmethod
    def batch_set_from(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]: ...

    @abstractmethod
    def get(self, key: bytes) -> bytes | None: ...

    @abstractmethod
    def set(self, key: bytes, data: bytes) -> bool: ...

    def exists(self, key: bytes) -> bool:
        return self.batch_exists([key]) == 1

    def exists_each(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is present (not only the leading run); one call where the store allows."""
        return [self.exists(k) for k in keys]

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None:  # noqa: B027 - optional for backends without resources
        pass

    def attach_host_buffer(self, buffer: torch.Tensor) -> None:  # noqa: B027 - only zero-copy backends need it
        """Called once with the whole host pool (``HostKVPool.buffer``) before any transfer; zero-copy
        backends register it. Bytes between its pages (dim 0's stride past a page) are spare: a
        backend may use them (``PAGE_ROOM_BYTES``: L3 trailers, ``cache/storage/integrity.py``)."""


def _file(config: dict[str, Any]) -> StorageBackend:
    from tierserve.cache.storage.file import FileStorage

    return FileStorage.from_config(config)


def _mooncake(config: dict[str, Any]) -> StorageBackend:
    from tierserve.cache.storage.mooncake import MooncakeStorage  # loads Mooncake: only when asked for

    return MooncakeStorage.from_config(config)


def _dynamic(config: dict[str, Any]) -> StorageBackend:
    """Imports ``config["module_path"]`` and builds ``config["class_name"]`` with the whole config."""
    missing = {"module_path", "class_name"} - set(config)
    if missing:
        raise ValueError(f"the dynamic storage backend needs {sorted(missing)} in the extra config")
    cls = getattr(importlib.import_module(config["module_path"]), config["class_name"])
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise ValueError(f"{config['module_path']}.{config['class_name']} is not a StorageBackend")
    return cls(config)


BACKENDS: dict[StorageKind, Callable[[dict[str, Any]], StorageBackend]] = {
    StorageKind.FILE: _file,
    StorageKind.MOONCAKE: _mooncake,
    StorageKind.DYNAMIC: _dynamic,
}


def create_backend(kind: StorageKind | str, config: dict[str, Any]) -> StorageBackend:
    """The backend of ``kind`` built from its extra config; ``ValueError`` for an unknown kind."""
    return BACKENDS[StorageKind.parse(kind)](config)
