"""A node's KV events: the publisher wired to the engine's radix tree, and the snapshot a
subscriber asks for (``NodeService.KVSnapshot``) when it lost events."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from tierserve.cache.base import Snapshot as CacheSnapshot
from tierserve.cache.events import KVEventPublisher, KVEventRecorder
from tierserve.core.kv_events_auth import CurveKeys
from tierserve.engine.engine import Engine
from tierserve.proto import tierserve_pb2 as pb

log = logging.getLogger(__name__)

Snapshot = tuple[int, CacheSnapshot]  # (last batch number, (page key, medium) pairs)


def start_kv_events(engine: Engine, endpoint: str, interval_s: float = 0.01,
                    curve: CurveKeys | None = None) -> KVEventPublisher | None:
    """Binds a publisher at ``endpoint`` (``tcp://HOST:0``: any free port) and makes the engine's
    tree report to it. Call before the engine thread starts (the tree is that thread's alone).
    None when the engine has no prefix tree (``--disable-radix-cache``): nothing to report."""
    recorder = KVEventRecorder(engine.config.page_size)
    if not engine.cache.set_event_listener(recorder):
        log.warning("KV events are off: this engine has no prefix cache")
        return None
    publisher = KVEventPublisher(recorder, endpoint, interval_s=interval_s, curve=curve).start()
    log.info("KV events published on %s", publisher.endpoint)
    return publisher


def advertised_endpoint(bound: str, hostname: str) -> str:
    """The address peers connect to: a wildcard bind (``0.0.0.0``, ``::``) is named by
    ``hostname``, e.g. ``tcp://0.0.0.0:5557`` -> ``tcp://10.0.0.7:5557``."""
    parts = urlsplit(bound)
    if parts.hostname in ("0.0.0.0", "::", "*"):
        host = f"[{hostname}]" if ":" in hostname else hostname
        return f"{parts.scheme}://{host}:{parts.port}"
    return bound


def take_snapshot(engine: Engine, publisher: KVEventPublisher | None) -> Snapshot:
    """Engine thread only (``EngineLoop.call``): cuts the pending events into a batch first, so
    every event the snapshot reflects has a number <= the one returned and every later event a
    larger one. (-1, []) pages when KV events are off or the engine has no tree."""
    seq = publisher.recorder.flush() if publisher is not None else -1
    return seq, engine.cache.snapshot()


def snapshot_reply(snapshot: Snapshot) -> pb.KVSnapshotReply:
    """The snapshot as a message; any thread (kept off the engine thread: large trees)."""
    seq, entries = snapshot
    return pb.KVSnapshotReply(sequence=seq, entries=[pb.KVSnapshotEntry(key=k, medium=m) for k, m in entries])
