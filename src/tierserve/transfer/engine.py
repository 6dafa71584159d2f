"""A thin, typed handle on one Mooncake Transfer Engine: start it, register the KV arena once,
submit writes, wait for them.

Facts this relies on (measured; ``docs/mooncake.md``, the Transfer Engine): cost is per batch entry, not per
byte, so callers coalesce; ``get_batch_transfer_status`` blocks until a batch is done or failed
and releases the GIL meanwhile; a frozen peer holds a TCP transfer until the ``MC_TCP_*`` timeouts,
so callers also keep their own deadline.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

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

__all__ = ["EntryBudget", "Link", "PeerEngines", "Peers", "TransferEngineHandle", "TransferError", "TransferProtocol"]


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
        self._registered: list[tuple[int, int]] = []

    def register(self, tensor: torch.Tensor) -> None:
        """Registers a whole arena (never a page: every region travels in the handshake)."""
        if self._engine.register_memory(tensor.data_ptr(), tensor.nbytes) != 0:
            raise TransferError(f"registering {tensor.nbytes} bytes with the transfer engine failed")
        self._registered.append((tensor.data_ptr(), tensor.nbytes))

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
        False comes as soon as one block failed: the batch's other blocks may still be in flight.
        Each id may be waited for once."""
        return self._engine.get_batch_transfer_status([batch]) == 0

    def close(self) -> None:
        """Unregisters the arenas and drops the engine (its destructor stops it; slow)."""
        engine, self._engine = self._engine, None
        for base, _ in self._registered:
            engine.unregister_memory(base)
        del engine  # the last reference: the destructor runs on this thread

    def write(self, target: str, blocks: list[Block]) -> bool:
        """Synchronous write (benchmarks and probes)."""
        srcs, dsts, lens = (list(col) for col in zip(*blocks, strict=True))
        return self._engine.batch_transfer_sync_write(target, srcs, dsts, lens) == 0


MAX_INFLIGHT_ENTRIES = 2048  # blocks in flight on one engine (see EntryBudget)


class EntryBudget:
    """Blocks in flight on one transfer engine, at most ``limit``. Measured (``docs/mooncake.md``):
    an engine fails every batch in flight once about 2,500 entries are (2,100 passed, 3,000
    failed), whichever peers they go to; 2,000 each from two engines into one peer passed."""

    def __init__(self, limit: int = MAX_INFLIGHT_ENTRIES) -> None:
        self.limit, self.used = limit, 0
        self._cond = threading.Condition()

    def take(self, entries: int, block: bool) -> bool:
        """Reserves room for ``entries`` (always granted when nothing is in flight); False when
        there is none and ``block`` is False."""
        with self._cond:
            if block:
                self._cond.wait_for(lambda: self._fits(entries))
            elif not self._fits(entries):
                return False
            self.used += entries
            return True

    def give(self, entries: int) -> None:
        with self._cond:
            self.used -= entries
            self._cond.notify_all()

    def _fits(self, entries: int) -> bool:
        return self.used == 0 or self.used + entries <= self.limit


class Link(Protocol):
    """What a handoff submits one peer's batches through (``TransferEngineHandle``, or a wrapper
    that injects faults: ``transfer/faulty.py``)."""

    def submit(self, target: str, blocks: list[Block]) -> int:
        """Starts writing ``blocks`` into ``target``'s memory; returns a batch id; raises ``TransferError``."""
        ...

    def wait(self, batch: int) -> bool:
        """Blocks until the batch landed (True) or failed (False)."""
        ...


class Peers(Protocol):
    """Where a handoff gets its ``Link`` to each peer (``PeerEngines``): ``acquire`` before the
    first batch (raises ``TransferError`` if the link cannot start), ``release`` once the last one
    ended, and the link's ``budget`` of entries in flight in between."""

    def acquire(self, target: str) -> Link: ...

    def release(self, target: str) -> None: ...

    def budget(self, target: str) -> EntryBudget: ...


@dataclass
class _Peer:
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while its engine starts
    engine: TransferEngineHandle | None = None
    users: int = 0  # handoffs holding the engine; only an unused engine may be closed
    budget: EntryBudget = field(default_factory=EntryBudget)


class PeerEngines:
    """One transfer engine per destination peer, each with the same arenas registered.

    Measured (``docs/mooncake.md``): an engine serialises its handshakes, so the first transfer to
    a frozen peer held transfers to every other peer of the same engine for about a minute. With
    an engine per peer a frozen peer stalls only its own requests, and each peer has its own lock:
    starting one peer's engine never waits on another's. At most ``max_peers`` engines live (pods
    come and go): when a new peer needs one, the least recently used unused engines are closed on
    a background thread (closing is slow). Engines start on the caller's thread (a sender thread,
    never the model's); callers ``acquire`` an engine and ``release`` it when their batches ended.
    """

    def __init__(self, hostname: str, protocol: TransferProtocol, devices: str, arenas: list[torch.Tensor],
                 max_peers: int = 64) -> None:
        self.hostname, self.protocol, self.devices, self.arenas = hostname, protocol, devices, arenas
        self.max_peers = max_peers
        self._peers: OrderedDict[str, _Peer] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # guards the dict only: never held while an engine starts
        self.closed = 0

    def acquire(self, target: str) -> TransferEngineHandle:
        """The engine for ``target``, started on first use; raises ``TransferError`` if it cannot start."""
        peer = self._enter(target)
        try:
            with peer.lock:
                if peer.engine is None:
                    peer.engine = self._start(target)
                return peer.engine
        except BaseException:
            self.release(target)
            raise

    def release(self, target: str) -> None:
        """The caller's batches to ``target`` ended; the engine may now be closed to make room."""
        with self._lock:
            self._peers[target].users -= 1
            self._evict()

    def budget(self, target: str) -> EntryBudget:
        """The entries budget of ``target``'s engine (between ``acquire`` and ``release``)."""
        with self._lock:
            return self._peers[target].budget

    def __len__(self) -> int:
        return len(self._peers)

    def _enter(self, target: str) -> _Peer:
        with self._lock:
            peer = self._peers.setdefault(target, _Peer())
            self._peers.move_to_end(target)
            peer.users += 1
            self._evict()
            return peer

    def _evict(self) -> None:
        """Closes unused engines, oldest first, while more than ``max_peers`` exist (lock held)."""
        idle = [t for t, p in self._peers.items() if p.users == 0]
        for target in idle[: max(0, len(self._peers) - self.max_peers)]:
            peer = self._peers.pop(target)
            if peer.engine is not None:
                self.closed += 1
                threading.Thread(target=peer.engine.close, name="transfer-close", daemon=True).start()

    def _start(self, target: str) -> TransferEngineHandle:
        """A new engine with the arenas registered (its handshake with ``target`` comes on first use)."""
        engine = TransferEngineHandle(self.hostname, self.protocol, self.devices)
        for arena in self.arenas:
            engine.register(arena)
        return engine
