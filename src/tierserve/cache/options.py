"""HiCache option values (torch-free, so configs and the CLI can name them cheaply)."""

from __future__ import annotations

from enum import Enum


class HostLayout(Enum):
    """How the L2 pool orders KV; see ``host_pool``."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"


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

    BEST_EFFORT = "best_effort"  # as soon as the scheduler can run it; use what arrived
    WAIT_COMPLETE = "wait_complete"  # when every page arrived
    TIMEOUT = "timeout"  # when every page arrived or the prefetch timeout passed


def object_format(layout: HostLayout) -> str:
    """The byte order of a page as one L3 object for a host layout: ``layer_first`` pages are
    staged into the ``page_first`` order, the two page-first layouts are stored as they are."""
    return HostLayout.PAGE_FIRST_DIRECT.value if layout is HostLayout.PAGE_FIRST_DIRECT else HostLayout.PAGE_FIRST.value
