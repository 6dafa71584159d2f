"""Names of the L3 storage tier that the CLI, the admin APIs and the cache share."""

from __future__ import annotations

from enum import StrEnum
from typing import Self


class _Named(StrEnum):
    @classmethod
    def parse(cls, name: str) -> Self:
        """The member named ``name``; ``ValueError`` naming the choices otherwise."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown {cls._what()} {name!r}; choose {', '.join(cls)}") from None

    @classmethod
    def _what(cls) -> str:
        return "value"


class StorageKind(_Named):
    """An L3 backend (``--hicache-storage-backend``); ``cache.storage.base`` maps each to its class."""

    FILE = "file"  # a directory
    MOONCAKE = "mooncake"  # Mooncake Store
    DYNAMIC = "dynamic"  # ``module:Class`` named in the extra config

    @classmethod
    def _what(cls) -> str:
        return "storage backend"


class StorageAction(_Named):
    """What the L3 admin API (``/admin/storage``, ``NodeService``) can ask of a cache."""

    STATUS = "status"
    ATTACH = "attach"  # needs an idle engine
    DETACH = "detach"  # needs an idle engine
    CLEAR = "clear"  # needs an idle engine

    @classmethod
    def _what(cls) -> str:
        return "storage action"


class StorageBusyError(RuntimeError):
    """An L3 admin action that needs an idle cache (or another state) was refused."""


class StorageAdminError(RuntimeError):
    """An L3 admin action failed on some rank of the node (the store refused it, a rank failed);
    the node is left consistent: no rank attached where another is not."""


class StorageUnavailableError(ValueError):
    """The cache has no L3 tier to act on (no host tier, so none can be attached)."""
