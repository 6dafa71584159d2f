"""Tree bookkeeping of L1 -> L2 writes: which nodes write-back copies ahead of eviction, and how a
landed (or failed) write is applied to nodes that may have been split while it was in flight."""

from __future__ import annotations

from tierserve.cache.radix_tree import Node, RadixTree

# Write-back starts copying the least recently used L1-only nodes to L2 once fewer than this share
# of the L1 pages are free, so that eviction finds them clean (``HiCache._write_back_ahead``).
WRITE_BACK_LOW_WATERMARK = 0.25


def dirty_lru(tree: RadixTree, num_pages: int) -> list[Node]:
    """The nodes without an L2 copy (nor one on its way) among the next ``num_pages`` device pages
    eviction would take: what write-back should copy now so that the eviction finds them clean."""
    return [n for n in tree.next_device_victims(num_pages) if n.host is None and not n.writing]


def end_failed_write(node: Node, num_pages: int) -> None:
    """A failed write's span may have been split meanwhile: no part of it is in flight any more
    (a part left marked would never be written to L2 again)."""
    while num_pages > 0:
        node.writing = False
        num_pages -= node.num_pages
        node = node.parent


def assign_host(tree: RadixTree, node: Node, pages: list[int]) -> None:
    """Gives a written span's host pages to the node(s) it covers now (it may have been split)."""
    while pages:
        tree.set_host(node, pages[-node.num_pages :])
        pages = pages[: -node.num_pages]
        node.writing = False
        node = node.parent
