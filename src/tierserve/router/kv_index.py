"""The router's view of which prefix pages each worker caches in L1 (device) and L2 (host), and
which pages the cluster's L3 holds.

``KVIndex`` is fed by the workers' KV events (``cache.events``) and corrected by snapshots;
``KVEventSubscriber`` runs the ZMQ SUB sockets (one asyncio task per worker) that feed it. L3 is
shared by every node, so it is one set for the cluster (``L3Pages``), fed by any node's ``storage``
events (a backup that reached the store) and bounded: the store evicts unseen, so it is a hint
for the TTFT prediction only. No torch here: the router never imports it.

Consistency: events carry sequence numbers ``0, 1, 2, ...`` per publisher. Anything but
``last + 1`` (lost messages, a restarted node), a new connection, or a first contact makes the
worker *unsynced*: the index asks for a snapshot through its callback, buffers the batches that
arrive meanwhile, and on ``reset`` replaces the worker's sets with the snapshot and replays the
buffered batches numbered after it. Until then ``match`` answers from the last known state (a
routing hint may be stale; it is never used for correctness).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from tierserve.cache.events import (
    DEFAULT_TOPIC,
    DEVICE,
    HOST,
    STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_seq,
)
from tierserve.cache.hashing import page_keys, salted_seed
from tierserve.core.kv_events_auth import CurveKeys, secure_subscriber

log = logging.getLogger(__name__)

SnapshotEntries = Iterable[tuple[bytes, str]]  # (page key, medium)
SnapshotFetcher = Callable[[str], Awaitable[tuple[int, SnapshotEntries]]]  # worker -> (seq, entries)
_MEDIUM = {DEVICE: DEVICE, HOST: HOST, None: DEVICE, "GPU": DEVICE, "CPU": HOST}  # vLLM's names too
L3_KEYS = 1 << 18  # L3 page keys remembered (32 bytes each, some 20 MB with the dict's own)


def prompt_keys(seed: bytes, salt: str, token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """The page keys of a prompt's full pages, as a worker with namespace ``seed`` names them."""
    return page_keys(salted_seed(seed, salt), token_ids, page_size)


class L3Pages:
    """The page keys some node said it wrote to L3, the last ``capacity`` of them (a store evicts
    without telling: older keys are the likelier gone)."""

    def __init__(self, capacity: int = L3_KEYS) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._keys[bytes(key)] = None
            self._keys.move_to_end(bytes(key))
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def discard(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._keys.pop(bytes(key), None)

    def run(self, keys: Sequence[bytes], start: int) -> int:
        """How many of ``keys`` from ``start`` on it holds, up to the first it lacks."""
        n = start
        while n < len(keys) and keys[n] in self._keys:
            n += 1
        return n - start


@dataclass
class _Worker:
    device: set[bytes] = field(default_factory=set)
    host: set[bytes] = field(default_factory=set)
    last_seq: int | None = None  # None: unsynced (waiting for a snapshot)
    from_snapshot: bool = False  # last_seq came from a snapshot, no batch applied since
    buffer: list[tuple[int, EventBatch]] = field(default_factory=list)


class KVIndex:
    """Per worker, the sets of page keys held in device and in host memory.

    ``request_snapshot(worker)`` is called when the worker becomes unsynced (once per gap until
    ``reset``; again on every ``invalidate``, when a snapshot taken before it would be stale);
    whoever it is must eventually call ``reset`` or ``remove_worker``. Single-threaded:
    call everything from one thread (the router's event loop).
    """

    def __init__(self, request_snapshot: Callable[[str], None], max_buffered: int = 4096) -> None:
        self._request_snapshot = request_snapshot
        self.max_buffered = max_buffered
        self._workers: dict[str, _Worker] = {}
        self._asked: set[str] = set()  # snapshot requested, reset not yet called
        self.gaps = 0
        self.storage = L3Pages()  # the cluster's L3, from every worker's events

    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    def is_synced(self, worker: str) -> bool:
        w = self._workers.get(worker)
        return w is not None and w.last_seq is not None

    def invalidate(self, worker: str) -> None:
        """Forgets the worker's position in its event stream (e.g. it (re)connected) and asks for
        a fresh snapshot even if one was asked before (that one may predate a restart); its sets
        stay as they are until the snapshot replaces them."""
        w = self._workers.setdefault(worker, _Worker())
        w.last_seq, w.from_snapshot = None, False
        self._asked.add(worker)
        self._request_snapshot(worker)

    def apply(self, worker: str, seq: int, batch: EventBatch) -> bool:
        """Applies batch ``seq`` if it follows the last one; otherwise buffers it (and asks for a
        snapshot when this is a gap). Returns whether it was applied.

        Right after a snapshot, batches it already covers (``seq <= snapshot_seq``) may still be
        on their way and are skipped; once the stream moved on, a number that goes back means a
        restarted publisher and is a gap like any other."""
        w = self._workers.setdefault(worker, _Worker())
        if w.from_snapshot and w.last_seq is not None and seq <= w.last_seq:
            return False
        if w.last_seq is not None and seq != w.last_seq + 1:
            self._gap(worker, w, f"got batch {seq} after {w.last_seq}")
        if w.last_seq is None:
            self._buffer(w, seq, batch)
            self._ask(worker)
            return False
        _apply_events(w, batch, self.storage)
        w.last_seq, w.from_snapshot = seq, False
        return True

    def heard(self, worker: str, seq: int) -> None:
        """The worker's publisher sent (or lost) every batch up to ``seq`` (its heartbeat): one beyond
        the last applied was lost with none after it to show the gap, so resynchronise. Batches come
        in order on the socket, so one not applied by now never will be."""
        w = self._workers.get(worker)
        if w is None or w.last_seq is None or seq <= w.last_seq:
            return
        self._gap(worker, w, f"the publisher is at batch {seq}, we at {w.last_seq}")
        self._ask(worker)

    def _gap(self, worker: str, w: _Worker, what: str) -> None:
        """Events of ``worker`` were lost: its sets wait for a snapshot (``_ask``)."""
        log.warning("KV events of %s: %s, resynchronising", worker, what)
        self.gaps += 1
        w.last_seq = None

    def reset(self, worker: str, snapshot_seq: int, entries: SnapshotEntries) -> None:
        """Replaces the worker's sets by a snapshot taken after batch ``snapshot_seq`` (-1: before
        any), then replays the buffered batches numbered after it."""
        w = self._workers.setdefault(worker, _Worker())
        self._asked.discard(worker)
        w.device, w.host = set(), set()
        for key, medium in entries:
            (w.host if _MEDIUM.get(medium) == HOST else w.device).add(bytes(key))
        w.last_seq, w.from_snapshot = snapshot_seq, True
        buffered, w.buffer = w.buffer, []
        for seq, batch in buffered:
            if seq > snapshot_seq:
                self.apply(worker, seq, batch)

    def remove_worker(self, worker: str) -> None:
        self._workers.pop(worker, None)
        self._asked.discard(worker)

    def match(self, worker: str, keys: Sequence[bytes]) -> tuple[int, int]:
        """(device_pages, host_pages): how many leading ``keys`` the worker holds in L1, then how
        many of the following ones it holds in L2 (the match stops at the first key it lacks)."""
        w = self._workers.get(worker)
        if w is None:
            return 0, 0
        d = 0
        while d < len(keys) and keys[d] in w.device:
            d += 1
        h = d
        while h < len(keys) and (keys[h] in w.host or keys[h] in w.device):
            h += 1
        return d, h - d

    def counts(self, worker: str) -> tuple[int, int]:
        """(device, host) pages the worker is known to hold."""
        w = self._workers.get(worker)
        return (len(w.device), len(w.host)) if w is not None else (0, 0)

    def _buffer(self, w: _Worker, seq: int, batch: EventBatch) -> None:
        if w.buffer and seq <= w.buffer[-1][0]:
            w.buffer.clear()  # the numbers went back: a new publisher, the old batches mean nothing
        w.buffer.append((seq, batch))
        if len(w.buffer) > self.max_buffered:
            del w.buffer[0]  # the replay then sees a gap and asks again

    def _ask(self, worker: str) -> None:
        if worker not in self._asked:
            self._asked.add(worker)
            self._request_snapshot(worker)


def _apply_events(w: _Worker, batch: EventBatch, storage: L3Pages) -> None:
    for event in batch.events:
        if isinstance(event, BlockStored | BlockRemoved) and event.medium == STORAGE:
            (storage.add if isinstance(event, BlockStored) else storage.discard)(event.block_hashes)
        elif isinstance(event, BlockStored):
            (w.host if _MEDIUM.get(event.medium) == HOST else w.device).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            (w.host if _MEDIUM.get(event.medium) == HOST else w.device).difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            w.device.clear()
            w.host.clear()


class KVEventSubscriber:
    """Subscribes to workers' KV event publishers and keeps ``index`` up to date.

    ``fetch_snapshot(worker)`` returns ``(seq, entries)`` (the router calls the node's
    ``KVSnapshot`` rpc); it is retried with backoff until it succeeds or the worker is removed.
    Every (re)connection to a publisher forces a snapshot, so a restarted node is resynchronised
    even if its new sequence numbers happen to continue the old ones. Use inside one event loop.
    """

    def __init__(self, fetch_snapshot: SnapshotFetcher, topic: bytes = DEFAULT_TOPIC, retry_s: float = 0.2,
                 max_retry_s: float = 5.0, curve: CurveKeys | None = None) -> None:
        """``curve``: subscribe under ZMQ CURVE (the cluster has a node token: ``core/kv_events_auth.py``)."""
        self.curve = curve
        self.fetch_snapshot, self.topic, self.retry_s, self.max_retry_s = fetch_snapshot, topic, retry_s, max_retry_s
        self.index = KVIndex(self._request_snapshot)
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task] = {}
        self._snapshots: dict[str, asyncio.Task] = {}
        self._cancelled: set[asyncio.Task] = set()  # still closing their sockets

    def add(self, worker: str, endpoint: str) -> None:
        """Starts following ``worker``'s publisher at ``endpoint`` (replaces an earlier one).
        No snapshot is asked yet: connecting asks for it (before that there is nothing to follow)."""
        self._cancel(worker)
        self._tasks[worker] = asyncio.create_task(self._follow(worker, endpoint), name=f"kv-events-{worker}")

    def remove(self, worker: str) -> None:
        self._cancel(worker)
        self.index.remove_worker(worker)

    async def close(self) -> None:
        for worker in list(self._tasks):
            self.remove(worker)
        await asyncio.gather(*self._cancelled, return_exceptions=True)
        self._ctx.destroy(linger=0)

    def _cancel(self, worker: str) -> None:
        for task in (self._tasks.pop(worker, None), self._snapshots.pop(worker, None)):
            if task is not None:
                task.cancel()
                self._cancelled.add(task)
                task.add_done_callback(self._cancelled.discard)

    async def _follow(self, worker: str, endpoint: str) -> None:
        """Reads the worker's batches into the index and watches its connections."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        if self.curve is not None:
            secure_subscriber(sub, self.curve)
        monitor = sub.get_monitor_socket(_CONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sub.connect(endpoint)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    self._on_monitor(worker, await monitor.recv_multipart())
                if sub in ready:
                    self._on_message(worker, await sub.recv_multipart())
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _on_monitor(self, worker: str, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        if event["event"] & _CONNECTED:  # first contact or a (restarted) node came back
            log.info("KV events of %s: connected to %s", worker, event["endpoint"])
            self.index.invalidate(worker)

    def _on_message(self, worker: str, frames: list[bytes]) -> None:
        try:
            if len(frames) == 2:  # a heartbeat: the publisher's last batch number (cache/events.py)
                self.index.heard(worker, decode_seq(frames[1]))
                return
            seq, batch = decode_seq(frames[1]), decode_batch(frames[2])
        except (ValueError, IndexError) as exc:
            log.warning("KV events of %s: dropping a malformed message (%s)", worker, exc)
            self.index.invalidate(worker)  # it may have held events we needed
            return
        self.index.apply(worker, seq, batch)

    def _request_snapshot(self, worker: str) -> None:
        """Starts fetching a snapshot; one in flight is dropped (the newest request wins)."""
        if worker not in self._tasks:
            return
        old = self._snapshots.pop(worker, None)
        if old is not None:
            old.cancel()
        self._snapshots[worker] = asyncio.get_running_loop().create_task(self._snapshot(worker))

    async def _snapshot(self, worker: str) -> None:
        delay = self.retry_s
        try:
            while True:
                try:
                    seq, entries = await self.fetch_snapshot(worker)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the worker may be restarting: try again later
                    log.warning("KV snapshot of %s failed (%s); retrying in %.1f s", worker, exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.max_retry_s)
                    continue
                self._snapshots.pop(worker, None)  # before reset: a gap in the replay may ask again
                self.index.reset(worker, seq, entries)
                return
        finally:
            if self._snapshots.get(worker) is asyncio.current_task():
                del self._snapshots[worker]


# libzmq >= 4.3 reports a finished handshake (the subscription is then on its way); older ones
# only the TCP connection
_CONNECTED = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED)
