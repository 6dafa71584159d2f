"""Digests of a request's KV as handed from a prefill node to a decode node (``--handoff-integrity``,
``docs/architecture.md``, Tenancy and integrity): one 64-bit value per model layer, computed by the
senders over what they send and by the receivers over what landed in the reserved pages.

Why not XXH3 as for L3 objects: the two sides cut the KV differently (TP sizes, context-parallel
pages, pipeline stages, receive staging), and it lives on the device. So the digest is a keyed
sum: every 32-bit word ``x`` of K or V of KV head ``h`` at prompt position ``t`` in layer ``L`` adds
``x * a[L, kv, h, w] * b[t]`` (mod 2^64), the weights odd pseudo-random constants. A sum adds up
over any partition (each sender and receiver rank contributes its part), is a few tensor ops where
the KV is, and changes with any flipped bit (an odd weight times ``2^k`` is never 0 mod 2^64), with a
token moved to another position, a head or layer moved, K and V exchanged. It guards against
corruption and mix-ups, not a forger who knows the constants (nodes are trusted: Authenticated nodes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

MASK = (1 << 64) - 1
_SEED = 0x7469657273657276  # "tierserv": the same on every node


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 values, made odd."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))) | np.uint64(1)


def _signed(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x.view(np.int64).copy())


class DigestWeights:
    """The constants of one model's KV: per layer ``a`` of shape [2, kv heads, words per head],
    ``b`` per prompt position; cached per layer and device."""

    def __init__(self, num_kv_heads: int, head_bytes: int, device: torch.device) -> None:
        if head_bytes % 4:
            raise ValueError(f"a KV head of {head_bytes} bytes is not whole 32-bit words")
        self.num_kv_heads, self.words, self.device = num_kv_heads, head_bytes // 4, device
        self._layers: dict[int, torch.Tensor] = {}

    def heads(self, layer: int) -> torch.Tensor:
        """``a`` of the model's layer ``layer``: int64 [2, kv heads, words]."""
        if layer not in self._layers:
            n = 2 * self.num_kv_heads * self.words
            index = np.arange(n, dtype=np.uint64) + np.uint64((layer + 1) << 40) + np.uint64(_SEED)
            self._layers[layer] = _signed(_mix(index)).view(2, self.num_kv_heads, self.words).to(self.device)
        return self._layers[layer]

    def positions(self, positions: Sequence[int]) -> torch.Tensor:
        """``b`` of prompt positions: int64 [len(positions)]."""
        index = np.asarray(positions, dtype=np.uint64) ^ np.uint64(_SEED >> 1)
        return _signed(_mix(index)).to(self.device)


def slots_of(pages: Sequence[int | None], start: int, end: int, page_size: int) -> tuple[list[int], list[int]]:
    """Slots and prompt positions of tokens ``[start, end)`` through the page table ``pages``;
    a page None is not this rank's (context parallelism: another rank sends it) and is left out."""
    slots, positions = [], []
    for t in range(start, end):
        page = pages[t // page_size]
        if page is not None:
            slots.append(page * page_size + t % page_size)
            positions.append(t)
    return slots, positions


def layer_digest(layer_kv: torch.Tensor, weights: DigestWeights, layer: int, slots: list[int],
                 positions: list[int], heads: tuple[int, int, int]) -> torch.Tensor:
    """The digest (an int64 tensor of one element, left on the device: reading it would wait for
    the kernels) of heads ``heads`` = (first local head, count, the model's index of the first)
    at ``slots`` of ``layer_kv`` [2, slots, local heads, head_dim], the model's layer ``layer``."""
    lo, count, model_lo = heads
    if not slots or not count:
        return torch.zeros((), dtype=torch.int64, device=layer_kv.device)
    index = torch.tensor(slots, dtype=torch.long, device=layer_kv.device)
    x = layer_kv[:, index, lo:lo + count].contiguous().view(torch.int32).to(torch.int64)  # [2, T, h, words]
    a = weights.heads(layer)[:, model_lo:model_lo + count].unsqueeze(1)
    per_token = (x * a).sum(dim=(0, 2, 3))
    return (per_token * weights.positions(positions)).sum()


def as_unsigned(values: torch.Tensor) -> list[int]:
    """Digests as the proto carries them (fixed64)."""
    return [v & MASK for v in values.tolist()]


class SendDigests:
    """A sender rank's running digests of one handoff, one per model layer (zero where it sends
    nothing): ``add`` on the engine thread as layers are written, ``values`` once all were."""

    def __init__(self, buffer: torch.Tensor, weights: DigestWeights, heads: tuple[int, int], first_layer: int,
                 num_layers: int) -> None:
        """``buffer``: the rank's pool [layers, 2, slots, heads, dim], its arena layer 0 being the model's
        ``first_layer`` and its head 0 the model's ``heads[0]``; ``heads[1]``: bytes per head."""
        self.buffer, self.weights, self.first_layer = buffer, weights, first_layer
        self.held_start, self.head_bytes = heads
        self.sums = torch.zeros(num_layers, dtype=torch.int64, device=buffer.device)

    def add(self, layer: int, spans: list[tuple[int, int]], pages: Sequence[int | None], start: int, end: int,
            page_size: int) -> None:
        """Tokens ``[start, end)`` of arena layer ``layer`` sent as the byte spans (offset, length)
        of each slot that its routes take (``Route.src_offset``, ``Route.nbytes``)."""
        slots, positions = slots_of(pages, start, end, page_size)
        model_layer = self.first_layer + layer
        for offset, length in spans:
            lo, count = offset // self.head_bytes, length // self.head_bytes
            heads = (lo, count, self.held_start + lo)
            self.sums[model_layer] += layer_digest(self.buffer[layer], self.weights, model_layer, slots, positions,
                                                   heads)

    def values(self) -> list[int]:
        return as_unsigned(self.sums)
