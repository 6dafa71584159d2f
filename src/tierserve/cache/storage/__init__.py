"""L3 storage backends: a store of KV pages named by page key, shared by every node of a namespace."""

from tierserve.cache.storage.base import StorageBackend, StorageError, create_backend

__all__ = ["StorageBackend", "StorageError", "create_backend"]
