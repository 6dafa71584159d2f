"""Background tasks that keep the registry in step with where workers run."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from tierserve.router.registry import Registry
from tierserve.router.roles import Role

log = logging.getLogger(__name__)


def kubernetes_task(namespace: str | None, prefill_selector: str, decode_selector: str, port: int
                    ) -> Callable[[Registry], Awaitable[None]]:
    """Watches pods matching the selectors (in-cluster credentials) and adds ready ones to the
    registry, removing them when they stop being ready or go away."""

    async def run(registry: Registry) -> None:
        from tierserve.router.k8s import DiscoveryKind, KubernetesDiscovery

        discovery = KubernetesDiscovery.in_cluster(
            selectors={Role.PREFILL: prefill_selector, Role.DECODE: decode_selector}, port=port, namespace=namespace)
        async for event in discovery.events():
            if event.kind is DiscoveryKind.ADDED:
                await registry.check(registry.add(event.role, event.address))
            else:
                await registry.remove(event.role, event.address)

    return run
