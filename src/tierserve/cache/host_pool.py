"""The L2 KV pool in host memory, in one of three layouts, and the L1 <-> L2 page copies.

Layouts (``--hicache-mem-layout``), for L layers, page size P, H KV heads, head dim D:

- ``layer_first``       [L, 2, pages * P, H, D]  like the device pool.
- ``page_first``        [pages, P, L, 2, H, D]   one page is one contiguous span (one L3 object,
                                                  written zero-copy), token-major inside.
- ``page_first_direct`` [pages, L, 2, P, H, D]   one page is one contiguous span and, inside it,
                                                  each layer's K (or V) is one block, so L1 <-> L2
                                                  moves whole page-by-layer blocks.

I/O backends (``--hicache-io-backend``): ``direct`` copies block by block (a run of consecutive
pages on both sides is one block); ``kernel`` does one batched gather and scatter per layer.
"""

from __future__ import annotations

import torch

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.options import HostLayout, IOBackend

__all__ = ["HostKVPool", "HostLayout", "IOBackend", "copy_pages", "device_pages", "runs"]


class HostKVPool:
    """``num_pages`` host pages with their own allocator (strict ownership, ``check()``).

    ``pin_memory`` is for CUDA devices: pinned pages copy asynchronously and register with RDMA.
    """

    def __init__(self, geometry: KVGeometry, num_pages: int, layout: HostLayout, pin_memory: bool = False) -> None:
        g = geometry
        shapes = {
            HostLayout.LAYER_FIRST: (g.num_layers, 2, num_pages * g.page_size, g.num_kv_heads, g.head_dim),
            HostLayout.PAGE_FIRST: (num_pages, g.page_size, g.num_layers, 2, g.num_kv_heads, g.head_dim),
            HostLayout.PAGE_FIRST_DIRECT: (num_pages, g.num_layers, 2, g.page_size, g.num_kv_heads, g.head_dim),
        }
        self.geometry = geometry
        self.layout = layout
        self.num_pages = num_pages
        self.buffer = torch.zeros(shapes[layout], dtype=g.dtype, pin_memory=pin_memory)
        self.allocator = PageAllocator(num_pages)

    def pages(self, layer: int, kv: int) -> torch.Tensor:
        """View [pages, page_size, H, D] of one layer's K (kv=0) or V (kv=1); strided for page_first."""
        g = self.geometry
        if self.layout is HostLayout.LAYER_FIRST:
            return self.buffer[layer, kv].view(self.num_pages, g.page_size, g.num_kv_heads, g.head_dim)
        if self.layout is HostLayout.PAGE_FIRST:
            return self.buffer[:, :, layer, kv]
        return self.buffer[:, layer, kv]

    def run_all_layers(self, page: int, n: int) -> torch.Tensor:
        """Pages ``page .. page + n`` across all layers as a view [L, 2, n, page_size, H, D] (the
        device pool's order, so one strided ``copy_`` moves the run), whatever the layout."""
        ps = self.geometry.page_size
        if self.layout is HostLayout.LAYER_FIRST:
            return self.buffer[:, :, page * ps : (page + n) * ps].unflatten(2, (n, ps))
        if self.layout is HostLayout.PAGE_FIRST:  # [n, ps, L, 2, H, D]
            return self.buffer[page : page + n].permute(2, 3, 0, 1, 4, 5)
        return self.buffer[page : page + n].permute(1, 2, 0, 3, 4, 5)  # from [n, L, 2, ps, H, D]

    def page_span(self, page: int) -> torch.Tensor:
        """The whole page as one contiguous tensor (page_first layouts only): what L3 stores."""
        if self.layout is HostLayout.LAYER_FIRST:
            raise ValueError("layer_first pages are not contiguous; use page_first or page_first_direct")
        return self.buffer[page]


def device_pages(pool: DeviceKVPool, layer: int, kv: int) -> torch.Tensor:
    """View [pages, page_size, H, D] of one layer's K or V in the device pool."""
    g = pool.geometry
    return pool.layer(layer)[kv].view(pool.num_pages, g.page_size, g.num_kv_heads, g.head_dim)


def copy_layer(
    dst: torch.Tensor, dst_pages: list[int], src: torch.Tensor, src_pages: list[int], backend: IOBackend
) -> None:
    """dst[dst_pages[i]] = src[src_pages[i]] for page views of one layer's K or V."""
    if not dst_pages:
        return
    if backend is IOBackend.KERNEL:
        index = torch.tensor(src_pages, device=src.device)
        rows = src.index_select(0, index).to(dst.device, non_blocking=True)
        dst.index_copy_(0, torch.tensor(dst_pages, device=dst.device), rows)
        return
    for d, s, n in runs(dst_pages, src_pages):
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)


def runs(a: list[int], b: list[int]) -> list[tuple[int, int, int]]:
    """Coalesces page pairs into (a_start, b_start, length) runs consecutive on both sides."""
    out: list[tuple[int, int, int]] = []
    for x, y in zip(a, b, strict=True):
        if out and out[-1][0] + out[-1][2] == x and out[-1][1] + out[-1][2] == y:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((x, y, 1))
    return out


def copy_pages(
    device: DeviceKVPool, host: HostKVPool, device_ids: list[int], host_ids: list[int],
    to_host: bool, backend: IOBackend, layers: range | None = None,
) -> None:
    """Copies pages between L1 and L2, layer by layer (``layers`` limits it, for overlapped loads).

    The direct backend moving every layer copies each run of consecutive pages across all layers
    in one strided ``copy_``: one call per run instead of one per run, layer and K/V.
    """
    if layers is None and backend is IOBackend.DIRECT:
        _copy_runs_all_layers(device, host, device_ids, host_ids, to_host)
        return
    for layer in layers if layers is not None else range(device.geometry.num_layers):
        for kv in (0, 1):
            d, h = device_pages(device, layer, kv), host.pages(layer, kv)
            if to_host:
                copy_layer(h, host_ids, d, device_ids, backend)
            else:
                copy_layer(d, device_ids, h, host_ids, backend)


def _copy_runs_all_layers(
    device: DeviceKVPool, host: HostKVPool, device_ids: list[int], host_ids: list[int], to_host: bool
) -> None:
    ps = device.page_size
    for d, h, n in runs(device_ids, host_ids):
        dev = device.buffer[:, :, d * ps : (d + n) * ps].unflatten(2, (n, ps))
        if to_host:
            host.run_all_layers(h, n).copy_(dev, non_blocking=True)
        else:
            dev.copy_(host.run_all_layers(h, n), non_blocking=True)
