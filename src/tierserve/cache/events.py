"""KV events: which pages a node's cache stores or drops, per tier, published over ZMQ PUB.

The format follows vLLM's KV events (``vllm/distributed/kv_events.py``) so other indexers can
read it: a batch is the msgpack array ``[ts, [event, ...]]`` and each event an array tagged by
its class name, ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]`` or ``["AllBlocksCleared"]``.
Block hashes are our 32-byte chained page keys (``hashing.page_keys``); ``medium`` is
``"device"`` (L1), ``"host"`` (L2) or ``"storage"`` (L3: a ``BlockStored`` once a backup reached
the store, with no parent or tokens; L3 is shared by the cluster and evicts unseen, so no removal
follows and a node's snapshot holds none: ``StorageTier._announce``).

On the wire a batch is the multipart message ``[topic, seq, payload]`` with ``seq`` an 8-byte
big-endian counter that starts at 0 for each publisher; a subscriber that sees anything but
``last + 1`` lost events (or the publisher restarted) and must resynchronise from a snapshot.
An idle publisher sends a heartbeat, ``[topic, seq]`` with no payload, every ``HEARTBEAT_S``: batches
up to ``seq`` were sent (or lost), so a subscriber behind it lost the last ones even though no batch
follows (a reader of vLLM's format that expects three frames must skip two-frame messages).

Threads: the radix tree calls the ``KVEventRecorder`` on the engine thread (a list append under
an uncontended lock); ``KVEventPublisher``'s own thread batches and sends, so the engine never
waits on a socket. This module imports neither torch nor the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgpack
import zmq

from tierserve.core.kv_events_auth import CurveKeys, secure_publisher
from tierserve.core.tiers import CacheTier

log = logging.getLogger(__name__)

DEVICE = CacheTier.DEVICE  # L1
HOST = CacheTier.HOST  # L2
STORAGE = CacheTier.STORAGE  # L3 (stored events only)
MEDIUMS = (DEVICE, HOST)
DEFAULT_TOPIC = b"kv-events"
HEARTBEAT_S = 1.0  # an idle publisher says its last batch number this often (a subscriber's gap shows)


@dataclass(frozen=True)
class BlockStored:
    """Pages ``block_hashes`` (consecutive, chained from ``parent_block_hash``; None = a root)
    now have a copy in ``medium``."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    """Pages ``block_hashes`` no longer have a copy in ``medium``."""

    block_hashes: list[bytes]
    medium: str | None = DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    """The node holds no page in any tier."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)


# -- encoding ------------------------------------------------------------------------------------


def encode_batch(batch: EventBatch) -> bytes:
    return msgpack.packb([batch.ts, [_event_array(e) for e in batch.events]], use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """Inverse of ``encode_batch``; also reads vLLM batches (a trailing data-parallel rank is
    ignored). Raises ``ValueError`` on anything else."""
    try:
        data = msgpack.unpackb(payload, raw=False)
        return EventBatch(float(data[0]), [_event_from_array(e) for e in data[1]])
    except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed KV event batch: {exc}") from exc


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=False)


def decode_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise ValueError(f"KV event sequence number must be 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=False)


def _event_array(event: KVEvent) -> list:
    if isinstance(event, BlockStored):
        return ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                event.lora_id, event.medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


def _event_from_array(data: list) -> KVEvent:
    tag, fields = data[0], data[1:]
    if tag == "BlockStored":  # older vLLM versions had no medium field
        hashes, parent, tokens, size, lora = fields[:5]
        return BlockStored(list(hashes), parent, list(tokens), int(size), lora, fields[5] if len(fields) > 5 else None)
    if tag == "BlockRemoved":
        return BlockRemoved(list(fields[0]), fields[1] if len(fields) > 1 else None)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event {tag!r}")


# -- the tree's side -----------------------------------------------------------------------------


class KVEventListener(Protocol):
    """What ``RadixTree`` calls when pages gain or lose a copy in a tier (engine thread)."""

    def stored(self, keys: list[bytes], parent: bytes | None, token_ids: Sequence[int], medium: str) -> None: ...

    def removed(self, keys: list[bytes], medium: str) -> None: ...


class KVEventRecorder:
    """Collects the tree's events and cuts them into numbered batches.

    ``flush`` (any thread) turns the pending events into the batch numbered ``last_seq + 1``.
    Bounds: at most ``max_pending`` events wait for a flush and ``max_batches`` batches for the
    sender; past either, events are dropped and a sequence number is skipped, so subscribers see
    a gap and ask for a snapshot instead of silently drifting.
    """

    def __init__(self, page_size: int, max_pending: int = 65536, max_batches: int = 1024) -> None:
        self.page_size, self.max_pending = page_size, max_pending
        self._lock = threading.Lock()
        self.ready = threading.Condition(self._lock)  # notified when a batch is ready to send
        self._pending: list[KVEvent] = []
        self._batches: deque[tuple[int, EventBatch]] = deque(maxlen=max_batches)
        self._last_seq = -1
        self.dropped_events = 0

    def stored(self, keys: list[bytes], parent: bytes | None, token_ids: Sequence[int], medium: str) -> None:
        self._add(BlockStored(list(keys), parent, list(token_ids), self.page_size, None, medium))

    def removed(self, keys: list[bytes], medium: str) -> None:
        self._add(BlockRemoved(list(keys), medium))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def _add(self, event: KVEvent) -> None:
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self.dropped_events += len(self._pending) + 1
                self._pending = []
                self._last_seq += 1  # a number nobody receives: the subscribers' gap
                return
            self._pending.append(event)

    @property
    def last_seq(self) -> int:
        """The number of the last batch cut (-1 before the first)."""
        with self._lock:
            return self._last_seq

    def flush(self) -> int:
        """Cuts the pending events into a batch (if any) and returns ``last_seq``. Called on the
        engine thread right before a snapshot, every event reflected in the snapshot has a
        number <= the returned one, and every later event a larger one."""
        with self._lock:
            if self._pending:
                self._last_seq += 1
                if len(self._batches) == self._batches.maxlen:
                    self.dropped_events += len(self._batches[0][1].events)  # the sender fell behind
                self._batches.append((self._last_seq, EventBatch(time.time(), self._pending)))
                self._pending = []
                self.ready.notify()
            return self._last_seq

    def take(self) -> list[tuple[int, EventBatch]]:
        """The batches cut and not yet taken, oldest first."""
        with self._lock:
            out = list(self._batches)
            self._batches.clear()
            return out


# -- the publisher -------------------------------------------------------------------------------


class KVEventPublisher:
    """Sends a recorder's batches on a ZMQ PUB socket from a background thread.

    ``endpoint`` is what to bind (``tcp://127.0.0.1:0`` picks a free port); after ``start``,
    ``endpoint`` is the address actually bound. Pending events are cut into a batch every
    ``interval_s`` (or sooner when someone calls ``recorder.flush``, e.g. once per engine step).
    A PUB socket drops messages for slow subscribers rather than blocking; they see the gap at the
    next batch, or, when none follows, at the next heartbeat: after ``heartbeat_s`` without a
    message, ``[topic, seq]`` (no batch frame) says every batch up to ``seq`` was sent or lost.
    A subscriber that joined late (ZMQ's slow joiner: its subscription reaches this socket after
    its handshake) and missed the batch right after its snapshot learns it within ``heartbeat_s``.
    """

    def __init__(self, recorder: KVEventRecorder, endpoint: str, topic: bytes = DEFAULT_TOPIC,
                 interval_s: float = 0.01, curve: CurveKeys | None = None,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        """``curve``: publish under ZMQ CURVE to the holders of these keys only (``core/kv_events_auth.py``)."""
        self.recorder, self.endpoint, self.topic, self.interval_s = recorder, endpoint, topic, interval_s
        self.curve, self._auth, self.heartbeat_s = curve, None, heartbeat_s
        self._ctx: zmq.Context | None = None
        self._socket: zmq.Socket | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.sent_batches = 0
        self._done = -1  # every batch numbered up to this was sent or lost
        self._spoke = time.monotonic()  # when the last message left

    def start(self) -> KVEventPublisher:
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        if self.curve is not None:
            self._auth = secure_publisher(self._ctx, self._socket, self.curve)
        self._socket.bind(_wildcard_port(self.endpoint))
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread.start()  # the socket belongs to that thread from here on
        return self

    def stop(self) -> None:
        """Sends what is pending, then closes the socket."""
        self._stop.set()
        with self.recorder.ready:
            self.recorder.ready.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _run(self) -> None:
        assert self._socket is not None
        try:
            while not self._stop.is_set():
                with self.recorder.ready:
                    self.recorder.ready.wait(self.interval_s)
                self._send_ready()
                self._heartbeat()
            self._send_ready()
        except zmq.ZMQError:
            log.exception("KV event publisher stopped")
        finally:
            self._socket.close(linger=500)  # let the last batches leave

    def _send_ready(self) -> None:
        done = self.recorder.flush()  # every number up to it is taken below, or was lost before
        for seq, batch in self.recorder.take():
            self._send([self.topic, encode_seq(seq), encode_batch(batch)])
            self.sent_batches += 1
            done = max(done, seq)
        self._done = done

    def _heartbeat(self) -> None:
        if self._done >= 0 and time.monotonic() - self._spoke >= self.heartbeat_s:
            self._send([self.topic, encode_seq(self._done)])

    def _send(self, frames: list[bytes]) -> None:
        assert self._socket is not None
        self._socket.send_multipart(frames)
        self._spoke = time.monotonic()


def _wildcard_port(endpoint: str) -> str:
    """ZMQ spells "any free port" ``*``; accept the usual ``0`` too."""
    return endpoint[:-2] + ":*" if endpoint.startswith("tcp://") and endpoint.endswith(":0") else endpoint
