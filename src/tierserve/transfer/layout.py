"""Where a token's K or V lives in a KV arena, and the coalesced block list of a handoff (no
Mooncake import: the nodes and tests use it without loading the transfer engine)."""

from __future__ import annotations

from dataclasses import dataclass

Block = tuple[int, int, int]  # (source address, destination address, bytes)



@dataclass(frozen=True)
class KVArena:
    """An arena [num_layers, 2 (K, V), num_slots, kv_heads, head_dim] at ``base`` (the device
    pool's layout); ``slot_bytes`` is one token's K (or V) in one layer."""

    base: int
    num_layers: int
    num_slots: int
    slot_bytes: int
    page_size: int

    def address(self, layer: int, kv: int, slot: int) -> int:
        return self.base + ((layer * 2 + kv) * self.num_slots + slot) * self.slot_bytes

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size


def token_runs(src_pages: list[int], dst_pages: list[int], start: int, end: int, page_size: int
               ) -> list[tuple[int, int, int]]:
    """Tokens ``[start, end)`` as (source slot, destination slot, tokens) runs that are
    consecutive on both sides: pages allocated together usually are, so a long prompt is a few
    runs rather than one entry per page."""
    runs: list[tuple[int, int, int]] = []
    token = start
    while token < end:
        page, offset = divmod(token, page_size)
        n = min(page_size - offset, end - token)
        s, d = src_pages[page] * page_size + offset, dst_pages[page] * page_size + offset
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
        else:
            runs.append((s, d, n))
        token += n
    return runs


def layer_blocks(src: KVArena, dst: KVArena, runs: list[tuple[int, int, int]], layer: int) -> list[Block]:
    """One block per run for K and one for V of ``layer``."""
    return [
        (src.address(layer, kv, s), dst.address(layer, kv, d), n * src.slot_bytes)
        for kv in (0, 1)
        for s, d, n in runs
    ]
