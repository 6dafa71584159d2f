"""Where cached KV lives."""

from __future__ import annotations

from enum import StrEnum


class CacheTier(StrEnum):
    """A tier of the KV cache. A ``StrEnum``: its members are the strings the API, KV events and
    metrics use (``"device"``, ``"host"``, ``"storage"``), so they serialise as they are."""

    DEVICE = "device"  # L1: the device KV pool
    HOST = "host"  # L2: the node's host pool
    STORAGE = "storage"  # L3: the store shared by the cluster


TIERS = tuple(CacheTier)
