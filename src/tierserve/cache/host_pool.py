"""The L2 KV pool in host memory, in one of three layouts, and the L1 <-> L2 page copies.

Layouts (``--hicache-mem-layout``), for L layers, page size P, H KV heads, head dim D:

- ``layer_first``       [L, 2, pages * P, H, D]  like the device pool.
- ``page_first``        [pages, P, L, 2, H, D]   one page is one contiguous span (one L3 object,
                                                  written zero-copy), token-major inside.
- ``page_first_direct`` [pages, L, 2, P, H, D]   one page is one contiguous span and, inside it,
                                                  each layer's K (or V) is one block, so L1 <-> L2
                                                  moves whole page-by-layer blocks.

I/O backends (``--hicache-io-backend``): ``direct`` copies block by block (a run of consecutive
pages on both sides is one block); ``kernel`` moves all selected layers of the pages as batched
index ops that touch each byte once: one gather into (or scatter out of) each run of consecutive
pages on one side, whatever the order on the other (per layer when a load asks for one layer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.options import HostLayout, IOBackend
from tierserve.cache.sharded.cp_pages import PageOwnership, page_allocator

# Spare bytes after every page of a page-first layout: an L3 object's 16-byte trailer
# (``cache/storage/integrity.py``) lands there, so the object moves as one buffer, as fast as a
# page without a trailer (two buffers per object cost ~10-20% of a TCP read here).
PAGE_ROOM_BYTES = 16

__all__ = ["PAGE_ROOM_BYTES", "HostKVPool", "HostLayout", "IOBackend", "copy_pages", "device_pages", "host_page_bytes",
           "runs"]


class HostKVPool:
    """``num_pages`` host pages with their own allocator (strict ownership, ``check()``).

    ``pin_memory`` is for CUDA devices: pinned pages copy asynchronously and register with RDMA.
    ``ownership``: a CP rank's (``cache/sharded/cp_host.py``): the buffer holds this rank's ``num_pages``
    pages and the allocator hands out logical ids over every rank's (``num_pages`` x CP size).
    """

    def __init__(self, geometry: KVGeometry, num_pages: int, layout: HostLayout, pin_memory: bool = False,
                 ownership: PageOwnership | None = None) -> None:
        g = geometry
        shapes = {
            HostLayout.LAYER_FIRST: (g.num_layers, 2, num_pages * g.page_size, g.num_kv_heads, g.head_dim),
            HostLayout.PAGE_FIRST: (num_pages, g.page_size, g.num_layers, 2, g.num_kv_heads, g.head_dim),
            HostLayout.PAGE_FIRST_DIRECT: (num_pages, g.num_layers, 2, g.page_size, g.num_kv_heads, g.head_dim),
        }
        self.geometry = geometry
        self.layout = layout
        self.num_pages = num_pages
        self.buffer = _allocate(shapes[layout], g.dtype, pin_memory, layout is not HostLayout.LAYER_FIRST)
        self.allocator = page_allocator(ownership or PageOwnership(), num_pages)

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


def host_page_bytes(geometry: KVGeometry, layout: HostLayout) -> int:
    """The host memory one page takes in ``layout``: page-first pages carry their trailer's room."""
    return geometry.bytes_per_page + (0 if layout is HostLayout.LAYER_FIRST else PAGE_ROOM_BYTES)


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool, room: bool) -> torch.Tensor:
    """A zeroed pool; with ``room``, pages (dim 0) strided ``PAGE_ROOM_BYTES`` apart, each still contiguous."""
    if not room:
        return torch.zeros(shape, dtype=dtype, pin_memory=pin_memory)
    page = torch.Size(shape[1:]).numel()
    stride = page + PAGE_ROOM_BYTES // dtype.itemsize
    flat = torch.zeros(shape[0] * stride, dtype=dtype, pin_memory=pin_memory)
    return flat.as_strided(shape, (stride, *torch.empty(shape[1:], device="meta").stride()))


def device_pages(pool: DeviceKVPool, layer: int, kv: int) -> torch.Tensor:
    """View [pages, page_size, H, D] of one layer's K or V in the device pool."""
    g = pool.geometry
    return pool.layer(layer)[kv].view(pool.num_pages, g.page_size, g.num_kv_heads, g.head_dim)


def copy_layer(
    dst: torch.Tensor, dst_pages: list[int], src: torch.Tensor, src_pages: list[int], backend: IOBackend
) -> None:
    """dst[dst_pages[i]] = src[src_pages[i]] for page-major views (dim 0 is the page)."""
    if not dst_pages:
        return
    if backend is IOBackend.KERNEL:
        _gather_scatter(dst, dst_pages, src, src_pages)
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


# The gather (index_select into a run) copies at ~0.75 of memcpy on CPU, the scatter (index_copy_,
# an element-wise kernel) at ~0.5, but each op costs ~10-20 us of dispatch (~100 KiB of copying):
# gather into the destination runs unless they are both more numerous and smaller than this.
_GATHER_RUN_BYTES = 256 * 1024


def _gather_scatter(dst: torch.Tensor, dst_pages: list[int], src: torch.Tensor, src_pages: list[int]) -> None:
    """The kernel backend: a batched gather or scatter per run of consecutive pages on one side.

    Across devices (CUDA L1, host L2) an op cannot read one device and write the other, so the
    gather is staged on the source device and scattered on the destination. On one device the
    page pairs are sorted by one side so that it forms runs (allocators hand out mostly consecutive
    pages), and each run is moved by one op that reads and writes every byte once: a gather
    straight into a destination run, or a scatter straight out of a source run.
    """
    if dst.device != src.device:
        rows = src.index_select(0, torch.tensor(src_pages, device=src.device)).to(dst.device, non_blocking=True)
        dst.index_copy_(0, torch.tensor(dst_pages, device=dst.device), rows)
        return
    by_dst, dst_runs = _sorted_runs(dst_pages, src_pages)
    by_src, src_runs = _sorted_runs(src_pages, dst_pages)
    run_bytes = dst[0].numel() * dst.element_size() * len(dst_pages) / len(dst_runs)
    if len(dst_runs) <= len(src_runs) or run_bytes >= _GATHER_RUN_BYTES:
        index = torch.tensor(by_dst, device=src.device)
        for d, i, n in dst_runs:
            torch.index_select(src, 0, index[i : i + n], out=dst[d : d + n])
    else:
        index = torch.tensor(by_src, device=dst.device)
        for s, i, n in src_runs:
            dst.index_copy_(0, index[i : i + n], src[s : s + n])


def _sorted_runs(key: list[int], other: list[int]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Sorts the pairs by ``key``; returns ``other`` in that order and the runs of consecutive
    keys as (key_start, position in the sorted order, length)."""
    pairs = sorted(zip(key, other, strict=True))
    return [o for _, o in pairs], runs([k for k, _ in pairs], list(range(len(pairs))))


def copy_pages(
    device: DeviceKVPool, host: HostKVPool, device_ids: list[int], host_ids: list[int],
    to_host: bool, backend: IOBackend, layers: range | None = None,
) -> None:
    """Copies pages between L1 and L2 (``layers`` limits it, for overlapped layer-wise loads);
    returns once the bytes are in place, also on CUDA (see ``_copy_stream``).

    Both backends move every requested layer at once: direct copies each run of pages consecutive
    on both sides in one strided ``copy_``; kernel views both pools page-major over the selected
    layers, so one gather or scatter per run (see ``_gather_scatter``) covers all of them.
    """
    with _copy_stream(device):
        _copy(device, host, device_ids, host_ids, to_host, backend, layers)


@contextlib.contextmanager
def _copy_stream(device: DeviceKVPool) -> Iterator[None]:
    """On CUDA, the copies run on a side stream that first waits for the work already queued on
    the compute stream (a kernel that wrote KV is done before its pages are read), and the caller
    gets control back only when they completed: ``non_blocking`` copies return at once, and a host
    page must not be read (L3 backup) or reused while one still moves it. On CPU: nothing to do."""
    where = device.buffer.device
    if where.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(where)
    stream.wait_stream(torch.cuda.current_stream(where))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def _copy(
    device: DeviceKVPool, host: HostKVPool, device_ids: list[int], host_ids: list[int],
    to_host: bool, backend: IOBackend, layers: range | None,
) -> None:
    if backend is IOBackend.KERNEL:
        d, h = _page_major(device, host, layers)
        if to_host:
            copy_layer(h, host_ids, d, device_ids, backend)
        else:
            copy_layer(d, device_ids, h, host_ids, backend)
        return
    if layers is None:
        _copy_runs_all_layers(device, host, device_ids, host_ids, to_host)
        return
    for layer in layers:
        for kv in (0, 1):
            d, h = device_pages(device, layer, kv), host.pages(layer, kv)
            if to_host:
                copy_layer(h, host_ids, d, device_ids, backend)
            else:
                copy_layer(d, device_ids, h, host_ids, backend)


def _page_major(device: DeviceKVPool, host: HostKVPool, layers: range | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both pools as views [pages, layers, 2, page_size, H, D] (strided, no copy), so indexing
    dim 0 picks whole pages across the selected layers, whatever the host layout."""
    sel = slice(None) if layers is None else slice(layers.start, layers.stop, layers.step)
    d = device.buffer.unflatten(2, (device.num_pages, device.page_size)).permute(2, 0, 1, 3, 4, 5)
    h = host.run_all_layers(0, host.num_pages).permute(2, 0, 1, 3, 4, 5)
    return d[:, sel], h[:, sel]


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
