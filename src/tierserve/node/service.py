"""``NodeService`` (every role): identity, load, routers' sessions, cache flush and run-time L3 control."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2

from tierserve.cache.events import KVEventPublisher
from tierserve.core.storage import StorageAction, StorageAdminError, StorageBusyError, StorageKind
from tierserve.engine.commands import FlushCache
from tierserve.engine.loop import EngineLoop
from tierserve.node.convert import identity
from tierserve.node.kv_events import snapshot_reply, take_snapshot
from tierserve.node.sessions import RouterSessions
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc


class NodeServicer(pb_grpc.NodeServiceServicer):
    def __init__(self, loop: EngineLoop, role: pb.Role, transfer_endpoint: str, model_name: str,
                 kv_events: KVEventPublisher | None, kv_events_endpoint: str, sessions: RouterSessions) -> None:
        self.loop, self.role, self.transfer_endpoint, self.model_name = loop, role, transfer_endpoint, model_name
        self.kv_events, self.kv_events_endpoint = kv_events, kv_events_endpoint
        self.sessions = sessions  # the node's (``Node.sessions``): its lost routers' requests are freed
        self.instance_id = uuid.uuid4().hex

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.NodeInfo:
        engine = self.loop.engine
        return pb.NodeInfo(role=self.role, model=self.model_name, identity=identity(engine),
                           namespace_digest=engine.namespace.digest(), transfer_endpoint=self.transfer_endpoint,
                           max_context_tokens=engine.max_model_len, namespace_seed=engine.namespace.seed(),
                           kv_events_endpoint=self.kv_events_endpoint, tp_size=engine.ranks.tp.size,
                           pp_size=engine.ranks.pp.size, cp_size=engine.ranks.cp.size,
                           kv_capacity_tokens=engine.capacity_tokens, instance_id=self.instance_id)

    async def KVSnapshot(self, request: pb.KVSnapshotRequest, context: grpc.aio.ServicerContext
                         ) -> pb.KVSnapshotReply:
        """The tree's pages per tier and the last event batch they reflect (for a router that lost events)."""
        return snapshot_reply(await self.loop.call(lambda e: take_snapshot(e, self.kv_events)))

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        return self._load()

    async def Session(self, request: pb.SessionRequest, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.LoadReport]:
        """A router's session: this node's load until the router goes, then its requests are freed."""
        async for report in self.sessions.session(request, self._load):
            yield report

    def _load(self) -> pb.LoadReport:
        s = self.loop.stats()
        return pb.LoadReport(running=int(s["running"]), waiting=int(s["waiting"]),
                             kv_pages_used=int(s["kv_pages_used"]), kv_pages_total=int(s["kv_pages_total"]),
                             reservations=int(s["reservations"]),
                             kv_pages_quarantined=int(s["reservation_pages_quarantined"]),
                             kv_pages_parked=int(s["handoff_pages_parked"]),
                             staging_bytes_used=int(s["reservation_staging_bytes"]),
                             prefill_backlog=self.loop.backlog(),
                             l3_read_tokens_per_second=s.get("cache_l3_read_tokens_per_second", 0.0))

    async def FlushCache(self, request: pb.FlushCacheRequest, context: grpc.aio.ServicerContext
                         ) -> pb.FlushCacheResponse:
        device, host = await self.loop.apply(FlushCache(request.device, request.host))  # on every rank
        return pb.FlushCacheResponse(device_pages=device, host_pages=host)

    async def AttachStorage(self, request: pb.StorageAttachRequest, context: grpc.aio.ServicerContext
                            ) -> pb.StorageStatus:
        config = json_format.MessageToDict(request.config)
        return await self._storage(context, StorageAction.ATTACH, request.backend, config)

    async def DetachStorage(self, request: pb.StorageRequest, context: grpc.aio.ServicerContext) -> pb.StorageStatus:
        return await self._storage(context, StorageAction.DETACH)

    async def ClearStorage(self, request: pb.StorageRequest, context: grpc.aio.ServicerContext) -> pb.StorageStatus:
        return await self._storage(context, StorageAction.CLEAR)

    async def GetStorageStatus(self, request: pb.StorageRequest, context: grpc.aio.ServicerContext
                               ) -> pb.StorageStatus:
        return await self._storage(context, StorageAction.STATUS)

    async def _storage(self, context: grpc.aio.ServicerContext, action: StorageAction, backend: str | None = None,
                       config: dict[str, Any] | None = None) -> pb.StorageStatus:
        try:
            kind = StorageKind.parse(backend) if backend else None
            status = await self.loop.storage_admin(action, kind, config)
        except StorageBusyError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except StorageAdminError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except (ValueError, ImportError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return storage_status(status)


def storage_status(status: dict[str, Any]) -> pb.StorageStatus:
    """The engine's status dict as a message; the backend's own stats are prefixed ``backend_``."""
    flat = {k: v for k, v in status.items() if k not in ("attached", "healthy", "backend")}
    backend = status.get("backend") or {}
    flat |= {f"backend_{k}": v for k, v in backend.items()}
    stats = struct_pb2.Struct()
    stats.update({k: v for k, v in flat.items() if isinstance(v, int | float | str | bool)})
    return pb.StorageStatus(attached=bool(status.get("attached")), backend=str(backend.get("backend", "")),
                            healthy=bool(status.get("healthy")), stats=stats)
