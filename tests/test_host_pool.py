"""L2 host pool: every layout and I/O backend moves exactly the right bytes."""

from __future__ import annotations

import pytest
import torch

from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.host_pool import HostKVPool, HostLayout, IOBackend, copy_pages, device_pages, runs

GEOMETRY = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float32)


def test_runs_coalesce_consecutive_pairs() -> None:
    assert runs([3, 4, 5, 9], [7, 8, 9, 1]) == [(3, 7, 3), (9, 1, 1)]
    assert runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]


@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("backend", list(IOBackend))
def test_round_trip_through_host(layout: HostLayout, backend: IOBackend) -> None:
    device = DeviceKVPool(GEOMETRY, 10, torch.device("cpu"))
    device.buffer.copy_(torch.randn_like(device.buffer))
    original = device.buffer.clone()
    host = HostKVPool(GEOMETRY, 8, layout)
    src, slots = [2, 3, 4, 7], [5, 6, 0, 1]
    copy_pages(device, host, src, slots, to_host=True, backend=backend)
    for layer in range(3):
        for kv in (0, 1):
            torch.testing.assert_close(host.pages(layer, kv)[slots], device_pages(device, layer, kv)[src],
                                       rtol=0, atol=0)
    dst = [9, 0, 1, 5]
    copy_pages(device, host, dst, slots, to_host=False, backend=backend)
    for layer in range(3):
        for kv in (0, 1):
            back = device_pages(device, layer, kv)[dst]
            want = original[layer, kv].view(10, 4, 2, 4)[src]
            torch.testing.assert_close(back, want, rtol=0, atol=0)
    untouched = [p for p in range(10) if p not in dst]
    for layer in range(3):
        assert torch.equal(device_pages(device, layer, 0)[untouched],
                           original[layer, 0].view(10, 4, 2, 4)[untouched])


def test_page_first_layouts_keep_a_page_contiguous() -> None:
    for layout in (HostLayout.PAGE_FIRST, HostLayout.PAGE_FIRST_DIRECT):
        host = HostKVPool(GEOMETRY, 4, layout)
        span = host.page_span(2)
        assert span.is_contiguous() and span.numel() * 4 == GEOMETRY.bytes_per_page
    with pytest.raises(ValueError):
        HostKVPool(GEOMETRY, 4, HostLayout.LAYER_FIRST).page_span(0)


PAGE_LISTS = {  # device pages, host pages: which side forms runs picks gather vs scatter
    "consecutive": ([2, 3, 4, 5], [4, 5, 6, 7]),
    "host_consecutive": ([9, 1, 5, 3], [3, 0, 2, 1]),
    "device_consecutive": ([7, 6, 9, 8], [7, 0, 3, 5]),
    "both_scattered": ([9, 0, 5, 2, 7], [3, 7, 1, 5, 0]),
}


@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("backend", list(IOBackend))
@pytest.mark.parametrize("case", list(PAGE_LISTS))
@pytest.mark.parametrize("layers", [None, range(1, 3), range(0, 1), range(0, 3, 2)])
def test_copy_pages_moves_exactly_the_selected_pages_and_layers(
    layout: HostLayout, backend: IOBackend, case: str, layers: range | None
) -> None:
    dev_ids, host_ids = PAGE_LISTS[case]
    source = DeviceKVPool(GEOMETRY, 10, torch.device("cpu"))
    source.buffer.copy_(torch.randn_like(source.buffer))
    host = HostKVPool(GEOMETRY, 8, layout)
    copy_pages(source, host, dev_ids, host_ids, to_host=True, backend=backend, layers=layers)
    target = DeviceKVPool(GEOMETRY, 10, torch.device("cpu"))
    copy_pages(target, host, dev_ids, host_ids, to_host=False, backend=backend, layers=layers)
    selected = set(layers if layers is not None else range(GEOMETRY.num_layers))
    others = [p for p in range(8) if p not in host_ids]
    for layer in range(GEOMETRY.num_layers):
        for kv in (0, 1):
            want = device_pages(source, layer, kv)[dev_ids]
            if layer not in selected:
                want = torch.zeros_like(want)
            assert torch.equal(host.pages(layer, kv)[host_ids], want)
            assert torch.equal(device_pages(target, layer, kv)[dev_ids], want)
            assert not host.pages(layer, kv)[others].any()
    untouched = [p for p in range(10) if p not in dev_ids]
    assert not target.buffer.view(3, 2, 10, -1)[:, :, untouched].any()
