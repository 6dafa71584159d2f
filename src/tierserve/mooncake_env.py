"""Mooncake's settings by environment variable, set before the library loads (it reads them at
load or engine start; the environment overrides these defaults). Measured reasons in
``docs/mooncake.md``."""

from __future__ import annotations

import os

from tierserve.core.transfer import TransferProtocol

DEFAULTS = {
    "MC_LOG_LEVEL": "ERROR",  # INFO logs ~30 lines per client
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",  # setup() against a dead master: ~4 s instead of ~90 s
    "MC_TRANSFER_TIMEOUT": "5",  # seconds (the minimum); RDMA transfers
    # a frozen peer holds a TCP transfer 30 s by default; MC_TRANSFER_TIMEOUT does not cover TCP
    "MC_TCP_STATUS_TIMEOUT_SEC": "5",
    "MC_TCP_PROGRESS_TIMEOUT_SEC": "5",
}


def apply_defaults() -> None:
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)


def show_mooncake_info() -> None:
    """``--log-level debug``: Mooncake's INFO lines too (set before it loads; the environment still wins)."""
    os.environ.setdefault("MC_LOG_LEVEL", "INFO")


def transfer_timeout_s(protocol: TransferProtocol) -> float:
    """The longest one transfer batch runs before Mooncake fails it, with the defaults applied: a
    writer that gave up can still land a batch until then (the decode grace must be longer)."""
    names = ("MC_TCP_STATUS_TIMEOUT_SEC", "MC_TCP_PROGRESS_TIMEOUT_SEC") if protocol is TransferProtocol.TCP \
        else ("MC_TRANSFER_TIMEOUT",)
    return max(float(os.environ.get(name) or DEFAULTS[name]) for name in names)
