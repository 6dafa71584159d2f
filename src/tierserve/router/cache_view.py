"""What the router knows of each worker's cache: a KV-event subscription per worker that
publishes events, and the per-prompt lookup the ``cache_aware`` policy scores with."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tierserve.core.kv_events_auth import CurveKeys
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.router.kv_index import KVEventSubscriber, SnapshotEntries, prompt_keys
from tierserve.router.policies import CachedPrefix
from tierserve.router.registry import Registry, Worker, WorkerState
from tierserve.router.roles import Role


def _key(worker: Worker) -> str:
    return f"{worker.role.value}/{worker.address}"


class CacheView:
    """Follows the KV events of every accepted worker that publishes them (``--kv-events-port``)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.subscriber: KVEventSubscriber | None = None
        self._following: dict[str, str] = {}  # worker key -> endpoint

    async def run(self, registry: Registry) -> None:
        """Keeps subscriptions in step with the registry until cancelled (an app task)."""
        token = self.registry.node_token
        self.subscriber = KVEventSubscriber(self._fetch, curve=CurveKeys.from_token(token) if token else None)
        try:
            while True:
                self._sync()
                await asyncio.sleep(registry.check_interval_s)
        finally:
            await self.subscriber.close()

    def _sync(self) -> None:
        live = {_key(w): w.info.kv_events_endpoint for w in self.registry.workers.values()
                if w.info is not None and w.info.kv_events_endpoint and w.state is not WorkerState.REFUSED}
        for key in [k for k in self._following if k not in live]:
            self.subscriber.remove(key)
            del self._following[key]
        for key, endpoint in live.items():
            if self._following.get(key) != endpoint:
                self.subscriber.add(key, endpoint)
                self._following[key] = endpoint

    async def _fetch(self, key: str) -> tuple[int, SnapshotEntries]:
        worker = next(w for w in self.registry.workers.values() if _key(w) == key)
        reply = await pb_grpc.NodeServiceStub(worker.channel).KVSnapshot(pb.KVSnapshotRequest(), timeout=10)
        return reply.sequence, [(e.key, e.medium) for e in reply.entries]

    def synced(self) -> bool:
        """Every available worker that publishes KV events is in the index, from its snapshot on:
        the router's readiness waits for it, so a router started late routes its first requests
        with a warm index (``docs/router.md``, several routers)."""
        publishing = [w for role in Role for w in self.registry.available(role) if w.info.kv_events_endpoint]
        if not publishing:
            return True
        index = self.subscriber.index if self.subscriber is not None else None
        return index is not None and all(index.is_synced(_key(w)) for w in publishing)

    def pages(self, worker: Worker) -> CachedPrefix:
        """Every page the router knows ``worker`` holds, in L1 and in L2 (for metrics)."""
        if self.subscriber is None or _key(worker) not in self._following:
            return CachedPrefix()
        return CachedPrefix(*self.subscriber.index.counts(_key(worker)))

    def lookup(self, token_ids: list[int], salt: str) -> Callable[[Worker], CachedPrefix]:
        """For one prompt: how many of its leading pages each worker holds in L1, then in L2."""
        info = self.registry.info
        if self.subscriber is None or info is None or not info.namespace_seed:
            return lambda worker: CachedPrefix()
        keys = prompt_keys(info.namespace_seed, salt, token_ids, info.identity.page_size)
        index = self.subscriber.index

        def cached(worker: Worker) -> CachedPrefix:
            if _key(worker) not in self._following:
                return CachedPrefix()
            device, host = index.match(_key(worker), keys)
            return CachedPrefix(device, host)

        return cached

    def l3_lookup(self, token_ids: list[int], salt: str) -> Callable[[int], int]:
        """For one prompt: given how many leading pages a worker holds (L1, L2), how many of the
        following ones the cluster's L3 holds (any node's ``storage`` events; ``KVIndex.storage``)."""
        info = self.registry.info
        if self.subscriber is None or info is None or not info.namespace_seed or not len(self.subscriber.index.storage):
            return lambda held: 0
        keys = prompt_keys(info.namespace_seed, salt, token_ids, info.identity.page_size)
        storage = self.subscriber.index.storage
        return lambda held: storage.run(keys, held)
