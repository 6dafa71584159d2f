"""Background tasks that keep the registry in step with where workers run."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

from tierserve.router.registry import Registry
from tierserve.router.roles import Role

log = logging.getLogger(__name__)


def sync_registry(discovery) -> Callable[[Registry], Awaitable[None]]:
    """A task adding the workers ``discovery.events()`` reports ready and removing the ones it
    reports gone; a new worker is health-checked at once so it gets traffic without waiting."""

    async def run(registry: Registry) -> None:
        from tierserve.router.k8s import DiscoveryKind

        async with contextlib.aclosing(discovery.events()) as events:
            async for event in events:
                if event.kind is DiscoveryKind.ADDED:
                    await registry.check(registry.add(event.role, event.address))
                else:
                    await registry.remove(event.role, event.address)

    return run


def kubernetes_task(namespace: str | None, prefill_selector: str, decode_selector: str, port: int
                    ) -> Callable[[Registry], Awaitable[None]]:
    """Watches pods matching the selectors with the pod's service account (in-cluster)."""
    from tierserve.router.k8s import KubernetesDiscovery

    selectors = {Role.PREFILL: prefill_selector, Role.DECODE: decode_selector}
    return sync_registry(KubernetesDiscovery.in_cluster(selectors=selectors, port=port, namespace=namespace))
