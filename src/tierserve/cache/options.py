"""The cache's own settings (torch-free, so configs and the CLI can name them cheaply)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tierserve.core.storage import StorageKind
from tierserve.core.test_hooks import refuse_test_switches


class CacheKind(Enum):
    """Which prefix cache an engine runs."""

    NONE = "none"  # --disable-radix-cache: nothing is reused
    RADIX = "radix"  # L1 only
    HIERARCHICAL = "hierarchical"  # L1 + L2 (+ L3 when a storage backend is set)


class HostLayout(Enum):
    """How the L2 pool orders KV; see ``host_pool``."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"


class DraftLayout(Enum):
    """Where a speculative draft's KV lives beside the target's (docs/speculative.md, draft KV in the cache)."""

    AUTO = "auto"  # packed when the draft's KV rows are shaped like the target's, else sidecar
    PACKED = "packed"  # the draft's layers follow the target's in one pool: one page, key, object for both
    SIDECAR = "sidecar"  # the draft's own device and host pools, indexed by the target's page ids


class IOBackend(Enum):
    """How L1 <-> L2 copies run: block by block, or one batched gather/scatter per layer."""

    DIRECT = "direct"
    KERNEL = "kernel"


class WritePolicy(Enum):
    """When a node of the tree is copied from L1 to L2."""

    WRITE_THROUGH = "write_through"  # when inserted or first hit
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # once hit ``write_threshold`` times
    WRITE_BACK = "write_back"  # only when L1 evicts it


class PrefetchPolicy(Enum):
    """When a request stops waiting for its L3 prefetch."""

    AUTO = "auto"  # wait while reading the pages is expected to be faster than computing them
    BEST_EFFORT = "best_effort"  # as soon as the scheduler can run it; use what arrived
    WAIT_COMPLETE = "wait_complete"  # when every page arrived
    TIMEOUT = "timeout"  # when every page arrived or the prefetch timeout passed


def object_format(layout: HostLayout) -> str:
    """The byte order of a page as one L3 object for a host layout: ``layer_first`` pages are
    staged into the ``page_first`` order, the two page-first layouts are stored as they are."""
    return HostLayout.PAGE_FIRST_DIRECT.value if layout is HostLayout.PAGE_FIRST_DIRECT else HostLayout.PAGE_FIRST.value


@dataclass(frozen=True)
class HiCacheOptions:
    """The host tier: ``ratio`` x the device pool, or ``size_gb`` when given (``--hicache-*``), and
    the optional L3 ``storage_backend`` configured by ``storage_config`` (the extra-config JSON;
    it also overrides the prefetch threshold and timeouts). A backend given by name is parsed
    (``ValueError`` for an unknown one, or for a test-only switch in ``storage_config``: ``core/test_hooks.py``)."""

    ratio: float = 2.0
    size_gb: float | None = None
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_threshold: int = 2
    mem_layout: HostLayout = HostLayout.PAGE_FIRST_DIRECT
    io_backend: IOBackend = IOBackend.KERNEL
    storage_backend: StorageKind | None = None
    storage_config: dict[str, Any] = field(default_factory=dict)
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.AUTO

    def __post_init__(self) -> None:
        refuse_test_switches(self.storage_config)
        if self.storage_backend is not None:
            object.__setattr__(self, "storage_backend", StorageKind.parse(self.storage_backend))
