"""Transfer settings that flags parse into (no Mooncake import, so ``--help`` stays fast)."""

from __future__ import annotations

from enum import Enum


class TransferProtocol(Enum):
    TCP = "tcp"  # works everywhere: tests, CI, laptops
    RDMA = "rdma"  # production, with a device list
