"""L3 on Mooncake Store: pages move zero-copy between the registered host pool and a pool of
memory segments that every client process contributes, indexed by a ``mooncake_master``.

Mooncake facts this module relies on (measured; see ``docs/mooncake.md``):

- Calls answer per key: bytes read or 0 on success, or a negative ``ErrorCode``. -704 is a miss,
  -200 a full store (it evicts in the background: the write is dropped, this is a cache),
  -9xx an unreachable master and -8xx a failed or timed-out transfer from a peer's segment.
- When a node dies, the master lists its segment for another ~10 s: gets of the objects it held
  and some puts (placed on it) fail with -800 after ~1 s each, on every surviving node. That is a
  dead peer's objects, not a broken store: those keys are misses (and dropped writes), counted as
  ``peer_failures``, and nothing raises (so no node switches L3 off for it).
- A put of an existing key answers 0 and keeps the old value: fine, a page key names its content.
- A dead master makes calls fail with -900, at once or after ~4.3 s (``get``); its port is
  probed (a TCP connect, refused at once) before each call after a failure so a down master
  costs little. A restarted master is empty; clients re-mount their segments within ~1-2 s.
- Any call after ``close()`` crashes the process, so calls and ``close`` are serialised here.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tierserve.cache.storage.base import StorageBackend, StorageError
from tierserve.cache.storage.integrity import (
    DIGEST_BYTES,
    PageRoom,
    Trailers,
    bytes_digest,
    span_digest,
    trailer_at,
    write_trailer,
)
from tierserve.mooncake_env import apply_defaults

apply_defaults()  # before Mooncake loads

try:
    from mooncake.store import MooncakeDistributedStore
except ImportError as _exc:  # `import mooncake` alone succeeds even when the engine cannot load
    raise ImportError(
        "the mooncake storage backend needs Mooncake: pip install mooncake-transfer-engine-non-cuda "
        "(CPU-only hosts) or mooncake-transfer-engine (CUDA hosts), not both, plus the system library "
        f"libibverbs1; importing mooncake.store failed: {_exc}"
    ) from _exc

log = logging.getLogger(__name__)
T = TypeVar("T")

NO_SPACE = -200
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
WRONG_SIZE = -1_000_001  # ours: an object whose size is not a page's plus its trailer


def is_outage(code: int) -> bool:
    """Codes that say the store, not the key, failed: internal error, RPC (-9xx), HA status (-1010,
    -1011). Everything else negative (not found, no space, a peer's transfer -8xx) is a miss."""
    return code == -1 or -999 <= code <= -900 or code in (-1010, -1011)


def is_peer_failure(code: int) -> bool:
    """A transfer from or to another node's segment failed (the node is dead or frozen)."""
    return -899 <= code <= -800


class MooncakeStorage(StorageBackend):
    """Pages under ``key_prefix + key.hex()`` in the Mooncake Store behind ``master_server_address``.

    One client per instance: it contributes ``global_segment_size`` bytes to the shared pool (what
    it holds is lost when it closes) and keeps ``local_buffer_size`` bytes for the byte-copy
    ``get``/``set``. Several instances in one process work (each has its own transfer engine).
    Spans must lie in memory registered by ``register_buffer`` (HiCache calls it through
    ``attach_host_buffer``); a span outside it registers its tensor's whole storage once (the host
    pool), never a page alone.

    Errors of the store raise ``StorageError``; a missing page or a full store is just ``False``.
    All methods may be called from any thread; they are serialised.
    """

    put_skips_existing = True  # a put of a stored key answers at once and keeps the object

    def __init__(self, master_server_address: str, *, local_hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "", global_segment_size: int = 256 << 20, local_buffer_size: int = 64 << 20,
                 metadata_server: str = "P2PHANDSHAKE", key_prefix: str = "tierserve/",
                 probe_timeout_s: float = 0.5, integrity: bool = True) -> None:
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake protocol must be tcp or rdma, not {protocol!r}")
        host, _, port = master_server_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f'master_server_address must be "host:port", not {master_server_address!r}')
        self.master, self._master = master_server_address, (host, int(port))
        self.prefix, self.probe_timeout_s = key_prefix, probe_timeout_s
        self._lock = threading.Lock()
        self._regions: list[tuple[int, int]] = []  # (address, bytes) registered with the store
        self._hot = (0, 0)  # (start, end) of the region that covered the last span located
        self._suspect = False  # the last call failed: probe the master before the next one
        self.hits = self.misses = self.writes = self.dropped = self.failures = self.peer_failures = 0
        self.integrity_failures = 0  # objects read back that failed their digest: misses, never KV
        self._probe()  # setup() against a dead master would block ~4 s first
        store = MooncakeDistributedStore()
        rc = store.setup(local_hostname, metadata_server, int(global_segment_size), int(local_buffer_size),
                         protocol, device_name, master_server_address)
        if rc != 0:
            raise StorageError(f"Mooncake store setup against master {master_server_address} failed ({rc})")
        self._store: MooncakeDistributedStore | None = store
        self._trailers = Trailers() if integrity else None
        self._room = PageRoom()  # host pool pages with room for their trailer: one buffer per object
        if self._trailers is not None:
            self.register_buffer(self._trailers.buffer)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MooncakeStorage:
        """Builds from the extra-config JSON; keys other than this backend's are ignored."""
        if "master_server_address" not in config:
            raise ValueError('the mooncake storage backend needs {"master_server_address": "host:port"}')
        names = ("local_hostname", "protocol", "device_name", "metadata_server", "key_prefix")
        kwargs: dict[str, Any] = {k: str(config[k]) for k in names if k in config}
        kwargs |= {k: int(config[k]) for k in ("global_segment_size", "local_buffer_size") if k in config}
        if "probe_timeout_s" in config:
            kwargs["probe_timeout_s"] = float(config["probe_timeout_s"])
        if "integrity" in config:
            kwargs["integrity"] = bool(config["integrity"])
        return cls(str(config["master_server_address"]), **kwargs)

    # -- memory registration ---------------------------------------------------------------------

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Registers ``buffer``'s whole storage (the host pool) for zero-copy transfers, once;
        registering a region already covered is a no-op. Call before the first batch call."""
        storage = buffer.untyped_storage()
        self._register(storage.data_ptr(), storage.nbytes())

    def attach_host_buffer(self, buffer: torch.Tensor) -> None:
        """HiCache's hook, called once with ``HostKVPool.buffer`` before any transfer."""
        self.register_buffer(buffer)
        self._room.add(buffer)

    def _register(self, address: int, nbytes: int) -> None:
        if self._covered(address, nbytes):
            return
        rc = self._call(lambda s: s.register_buffer(address, nbytes))
        if rc != 0:
            raise StorageError(f"Mooncake could not register {nbytes} bytes at {address:#x} ({rc})")
        self._regions.append((address, nbytes))

    def _covered(self, address: int, nbytes: int) -> bool:
        return any(a <= address and address + nbytes <= a + n for a, n in self._regions)

    def _locate(self, spans: list[torch.Tensor]) -> tuple[list[int], list[int]]:
        """Addresses and sizes of the spans, registering their storage if nobody did.

        On every call's path, right after a transfer has flushed the CPU caches, where each Python
        or torch step costs several µs: so it does little per span, and checks the region that
        covered the previous span (usually the host pool, for every span) before any other."""
        ptrs, sizes = [], []
        start, end = self._hot  # the region that covered the previous span
        for span in spans:
            if not span.is_cpu or not span.is_contiguous():
                raise ValueError("Mooncake spans must be contiguous CPU tensors (page_first host layouts)")
            ptr, nbytes = span.data_ptr(), span.nbytes
            if not (start <= ptr and ptr + nbytes <= end):
                if not self._covered(ptr, nbytes):
                    log.warning("registering a span's storage with Mooncake on first use; call register_buffer")
                    self.register_buffer(span)
                start, end = next((a, a + n) for a, n in self._regions if a <= ptr and ptr + nbytes <= a + n)
                self._hot = (start, end)  # regions are never unregistered
            ptrs.append(ptr)
            sizes.append(nbytes)
        return ptrs, sizes

    # -- pages -----------------------------------------------------------------------------------

    def _names(self, keys: list[bytes]) -> list[str]:
        return [self.prefix + k.hex() for k in keys]

    def batch_exists(self, keys: list[bytes]) -> int:
        if not keys:
            return 0
        names = self._names(keys)
        codes = self._checked("exists", lambda s: s.batch_is_exist(names))
        return next((i for i, c in enumerate(codes) if c != 1), len(codes))

    def exists_each(self, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []
        names = self._names(keys)
        return [c == 1 for c in self._checked("exists", lambda s: s.batch_is_exist(names))]

    def batch_get_into(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        if not keys:
            return []
        if self._trailers is not None:
            return self._chunked(self._get_checked, keys, spans)
        names, (ptrs, sizes) = self._names(keys), self._locate(spans)
        codes = self._checked("get", lambda s: s.batch_get_into(names, ptrs, sizes))
        ok = [c == n for c, n in zip(codes, sizes, strict=True)]  # a smaller object is not this page
        return self._count_hits(ok)

    def _count_hits(self, ok: list[bool]) -> list[bool]:
        hits = sum(ok)
        self.hits += hits
        self.misses += len(ok) - hits
        return ok

    def batch_set_from(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        if not keys:
            return []
        if self._trailers is not None:
            return self._chunked(self._put_checked, keys, spans)
        names, (ptrs, sizes) = self._names(keys), self._locate(spans)
        return self._count_puts(self._checked("put", lambda s: s.batch_put_from(names, ptrs, sizes)))

    def _count_puts(self, codes: list[int]) -> list[bool]:
        ok = [c == 0 or c == OBJECT_ALREADY_EXISTS for c in codes]
        stored = sum(ok)
        self.writes += stored - codes.count(OBJECT_ALREADY_EXISTS)
        self.dropped += len(ok) - stored  # full (-200, it evicts in the background) or refused: drop, a cache
        return ok

    def _stored(self, code: int) -> bool:
        ok = code in (0, OBJECT_ALREADY_EXISTS)
        self.writes += code == 0
        self.dropped += not ok  # full (-200, it evicts in the background) or refused: drop, a cache
        return ok

    # -- pages with a trailer (cache/storage/integrity.py) -----------------------------------------

    def _chunked(self, call: Callable[[list[bytes], list[torch.Tensor]], list[bool]], keys: list[bytes],
                 spans: list[torch.Tensor]) -> list[bool]:
        """``call`` over batches of at most one trailer buffer's slots."""
        step = self._trailers.lane_slots
        return [ok for i in range(0, len(keys), step) for ok in call(keys[i : i + step], spans[i : i + step])]

    def _parts(self, ptrs: list[int], sizes: list[int], base: int) -> tuple[list[list[int]], list[list[int]]]:
        """Each object as two buffers: its page in place, then its trailer's slot (from ``base``)."""
        return ([[p, self._trailers.address(base + i)] for i, p in enumerate(ptrs)],
                [[n, DIGEST_BYTES] for n in sizes])

    def _put_checked(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        names, (ptrs, sizes) = self._names(keys), self._locate(spans)
        if self._room.covers(ptrs, sizes):  # each trailer written into its page's room: one buffer
            for name, ptr, n in zip(names, ptrs, sizes, strict=True):
                write_trailer(ptr + n, span_digest(name.encode(), ptr, n))
            sealed = [n + DIGEST_BYTES for n in sizes]
            return self._count_puts(self._checked("put", lambda s: s.batch_put_from(names, ptrs, sealed)))
        with self._trailers.lend() as base:
            for i, (name, ptr, n) in enumerate(zip(names, ptrs, sizes, strict=True)):
                self._trailers.write(base + i, span_digest(name.encode(), ptr, n))
            parts = self._parts(ptrs, sizes, base)
            return self._count_puts(self._checked("put", lambda s: s.batch_put_from_multi_buffers(names, *parts)))

    def _get_checked(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        names, (ptrs, sizes) = self._names(keys), self._locate(spans)
        if self._room.covers(ptrs, sizes):  # each trailer lands in its page's room: one buffer
            sealed = [n + DIGEST_BYTES for n in sizes]
            codes = self._checked("get", lambda s: s.batch_get_into(names, ptrs, sealed))
            trailers = [trailer_at(p + n) for p, n in zip(ptrs, sizes, strict=True)]
            return self._verdicts(names, ptrs, sizes, codes, trailers)
        with self._trailers.lend() as base:
            parts = self._parts(ptrs, sizes, base)
            codes = self._checked("get", lambda s: s.batch_get_into_multi_buffers(names, *parts))
            return self._verdicts(names, ptrs, sizes, codes, self._trailers.read(base, len(names)))

    def _verdicts(self, names: list[str], ptrs: list[int], sizes: list[int], codes: list[int],
                  trailers: list[bytes]) -> list[bool]:
        """Per object, whether it is this page's, byte for byte; removes present ones that are not."""
        codes = [self._sized(name, c, n + DIGEST_BYTES) for name, c, n in zip(names, codes, sizes, strict=True)]
        ok = [self._intact(*args) for args in zip(trailers, names, ptrs, sizes, codes, strict=True)]
        self._drop([n for n, good, c in zip(names, ok, codes, strict=True) if not good and _present(c)])
        return self._count_hits(ok)

    def _sized(self, name: str, code: int, expected: int) -> int:
        """Mooncake answers a read into buffers of another size than the object with the same -800
        as a dead peer's object: the object's size tells them apart (a truncated object is
        present, a dead peer's a miss)."""
        if not is_peer_failure(code):
            return code
        size = self._call(lambda s: s.get_size(name))
        if size > 0 and size != expected:
            self.peer_failures -= 1  # ``_checked`` counted it as one
            return WRONG_SIZE
        return code

    def _intact(self, trailer: bytes, name: str, ptr: int, nbytes: int, code: int) -> bool:
        """Whether the object read into the page at ``ptr`` and ``trailer`` is this page's, byte for byte."""
        if not _present(code):
            return False  # a plain miss: not stored, evicted, or a dead peer's
        if code == nbytes + DIGEST_BYTES and span_digest(name.encode(), ptr, nbytes) == trailer:
            return True
        self.integrity_failures += 1
        return False

    def _drop(self, names: list[str]) -> None:
        """Removes objects that failed their check, so the page's next backup can store it again
        (a put of an existing name keeps the old object). Best effort: a failure is only logged."""
        if names:
            log.warning("%d L3 objects failed their integrity check; removed, their pages recomputed", len(names))
            try:
                self._call(lambda s: [s.remove(n, True) for n in names])  # forced: our read left a lease
            except StorageError as exc:
                log.warning("could not remove corrupt L3 objects: %s", exc)

    # -- single objects --------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        name = self._names([key])[0]
        data = self._call(lambda s: s.get(name))
        if data and self._trailers is not None:
            return self._unsealed(name, data)
        if data:
            return data
        code = self._checked("get", lambda s: [s.is_exist(name)])[0]  # b"" is both a miss and an error
        return b"" if code == 1 else None

    def set(self, key: bytes, data: bytes) -> bool:
        """Copies through the local buffer; empty objects are refused by Mooncake (False)."""
        name = self._names([key])[0]
        sealed = bytes(data) + bytes_digest(name.encode(), data) if self._trailers is not None else bytes(data)
        return self._stored(self._checked("put", lambda s: [s.put(name, sealed)])[0])

    def _unsealed(self, name: str, data: bytes) -> bytes | None:
        """The object's bytes without their trailer, or None (a miss, counted) when they fail it."""
        body, trailer = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
        if len(data) > DIGEST_BYTES and bytes_digest(name.encode(), body) == trailer:
            return body
        self.integrity_failures += 1
        self._drop([name])
        return None

    def clear(self) -> None:
        """Removes every object under this backend's prefix (from all clients), leased or not."""
        pattern = "^" + re.escape(self.prefix)
        self._checked("clear", lambda s: [min(0, s.remove_by_regex(pattern, True))])

    def stats(self) -> dict[str, Any]:
        return {"backend": "mooncake", "master": self.master, "hits": self.hits, "misses": self.misses,
                "writes": self.writes, "dropped": self.dropped, "failures": self.failures,
                "peer_failures": self.peer_failures, "integrity_failures": self.integrity_failures,
                "registered_buffers": len(self._regions), "registered_bytes": sum(n for _, n in self._regions),
                "master_suspect": self._suspect, "closed": self._store is None}

    def close(self) -> None:
        """Unmounts this client's segment (its objects are lost). Takes ~1.5-2 s, ~11 s when the
        master is down; later calls raise ``StorageError``."""
        with self._lock:
            store, self._store = self._store, None
            if store is not None:
                store.close()

    # -- calls -----------------------------------------------------------------------------------

    def _checked(self, op: str, fn: Callable[[MooncakeDistributedStore], list[int]]) -> list[int]:
        """Runs a call answering per-key codes; raises ``StorageError`` if one says the store failed."""
        codes = self._call(fn)
        self.peer_failures += sum(1 for c in codes if is_peer_failure(c))
        bad = next((c for c in codes if is_outage(c)), None) if codes and min(codes) < 0 else None
        if bad is not None:
            self._suspect = True
            self.failures += 1
            raise StorageError(f"Mooncake {op} failed ({bad}) with master {self.master}")
        self._suspect = False
        return codes

    def _call(self, fn: Callable[[MooncakeDistributedStore], T]) -> T:
        with self._lock:
            if self._store is None:
                raise StorageError("the Mooncake store is closed")
            if self._suspect:
                self._probe()
            try:
                return fn(self._store)
            except Exception as exc:  # a binding error: treat like an unreachable store
                self._suspect = True
                self.failures += 1
                raise StorageError(f"Mooncake call failed: {exc}") from exc

    def _probe(self) -> None:
        """Raises ``StorageError`` at once if the master's port does not accept a connection."""
        try:
            socket.create_connection(self._master, timeout=self.probe_timeout_s).close()
        except OSError as exc:
            self.failures += 1
            raise StorageError(f"Mooncake master {self.master} is unreachable: {exc}") from exc


def _present(code: int) -> bool:
    """A get's code for an object that exists (its size, or an error about reading it into these
    buffers), as against a miss: not found, or a dead peer's object."""
    return code != OBJECT_NOT_FOUND and not is_peer_failure(code)
