"""The L1 KV pool: one arena holding every layer's K and V pages on the compute device."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one rank's KV cache. ``num_kv_heads`` is this rank's share under tensor parallelism."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """K plus V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size


class DeviceKVPool:
    """``num_pages`` pages of KV in one tensor [layers, 2 (K, V), slots, kv_heads, head_dim].

    One arena (not one buffer per layer or page) so a transfer engine registers it once; a page's
    K (or V) in one layer is the contiguous slot range ``[page * page_size, (page + 1) * page_size)``,
    so runs of consecutive pages are contiguous too.
    """

    def __init__(self, geometry: KVGeometry, num_pages: int, device: torch.device) -> None:
        self.geometry = geometry
        self.num_pages = num_pages
        g = geometry
        shape = (g.num_layers, 2, num_pages * g.page_size, g.num_kv_heads, g.head_dim)
        self.buffer = torch.zeros(shape, dtype=g.dtype, device=device)

    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each [slots, kv_heads, head_dim]."""
        return self.buffer[layer_id, 0], self.buffer[layer_id, 1]
