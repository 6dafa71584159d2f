"""A thin, typed handle on one Mooncake Transfer Engine: start it, register the KV arena once,
submit writes, wait for them.

Facts this relies on (measured; ``docs/mooncake.md``, the Transfer Engine): cost is per batch entry, not per
byte, so callers coalesce; ``get_batch_transfer_status`` blocks until a batch is done or failed
and releases the GIL meanwhile; a frozen peer holds a TCP transfer until the ``MC_TCP_*`` timeouts,
so callers also keep their own deadline.
"""

from __future__ import annotations

import threading

import torch

from tierserve.core.transfer import TransferProtocol
from tierserve.mooncake_env import apply_defaults
from tierserve.transfer.layout import Block

apply_defaults()  # before Mooncake loads

try:
    from mooncake.engine import TransferEngine
except ImportError as _exc:  # `import mooncake` alone succeeds even when the engine cannot load
    raise ImportError(
        "KV transfer needs Mooncake: pip install mooncake-transfer-engine-non-cuda (CPU-only hosts) or "
        f"mooncake-transfer-engine (CUDA hosts), not both, plus the system library libibverbs1: {_exc}"
    ) from _exc

__all__ = ["TransferEngineHandle", "TransferError", "TransferProtocol"]


class TransferError(RuntimeError):
    """A handoff failed; the message says why."""


class TransferEngineHandle:
    """One engine per process. ``endpoint`` is how peers name it ("host:port")."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: TransferProtocol = TransferProtocol.TCP,
                 devices: str = "") -> None:
        self._engine = TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol.value, devices)
        if rc != 0:
            raise TransferError(f"transfer engine start failed on {hostname} over {protocol.value} ({rc})")
        self.endpoint = f"{hostname}:{self._engine.get_rpc_port()}"
        self._lock = threading.Lock()

    def register(self, tensor: torch.Tensor) -> None:
        """Registers a whole arena (never a page: every region travels in the handshake)."""
        if self._engine.register_memory(tensor.data_ptr(), tensor.nbytes) != 0:
            raise TransferError(f"registering {tensor.nbytes} bytes with the transfer engine failed")

    def submit(self, target: str, blocks: list[Block]) -> int:
        """Starts writing ``blocks`` into ``target``'s memory; returns a batch id for ``wait``."""
        srcs, dsts, lens = (list(col) for col in zip(*blocks, strict=True))
        with self._lock:
            batch = self._engine.batch_transfer_async_write(target, srcs, dsts, lens)
        if batch == 0:
            raise TransferError(f"submitting {len(blocks)} blocks to {target} failed")
        return batch

    def wait(self, batch: int) -> bool:
        """Blocks until the batch is in the peer's memory (True) or failed or timed out (False).
        Each id may be waited for once."""
        return self._engine.get_batch_transfer_status([batch]) == 0

    def write(self, target: str, blocks: list[Block]) -> bool:
        """Synchronous write (benchmarks and probes)."""
        srcs, dsts, lens = (list(col) for col in zip(*blocks, strict=True))
        return self._engine.batch_transfer_sync_write(target, srcs, dsts, lens) == 0


class PeerEngines:
    """One transfer engine per destination peer, each with the same arenas registered.

    Measured: an engine serialises its handshakes, so the first transfer to a frozen peer held
    transfers to every other peer of the same engine for about a minute. With an engine per peer
    a frozen peer stalls only its own requests. Engines are made on first use, on the caller's
    thread (a sender thread, never the model's).
    """

    def __init__(self, hostname: str, protocol: TransferProtocol, devices: str, arenas: list[torch.Tensor]) -> None:
        self.hostname, self.protocol, self.devices, self.arenas = hostname, protocol, devices, arenas
        self._engines: dict[str, TransferEngineHandle] = {}
        self._lock = threading.Lock()

    def for_target(self, target: str) -> TransferEngineHandle:
        with self._lock:
            engine = self._engines.get(target)
            if engine is None:
                engine = TransferEngineHandle(self.hostname, self.protocol, self.devices)
                for arena in self.arenas:
                    engine.register(arena)
                self._engines[target] = engine
            return engine
