"""Digests of a request's KV as handed from a prefill node to a decode node (``--handoff-integrity``,
``docs/tenancy.md``): one 64-bit value per model layer, computed by the
senders over what they send and by the receivers over what landed in the reserved pages.

Why not XXH3 as for L3 objects: the two sides cut the KV differently (TP sizes, context-parallel
pages, pipeline stages, receive staging), and it lives on the device. So the digest is a keyed
sum: every 32-bit word ``x`` of K or V of KV head ``h`` at prompt position ``t`` in layer ``L`` adds
``x * a[L, kv, h, w] * b[t]`` (mod 2^32), the weights odd pseudo-random constants. A sum adds up
over any partition (each sender and receiver rank contributes its part), is a matrix-vector product
per layer where the KV is (int32 on CPU: ~10 GB/s a core here, where int64 ops ran at 0.1), and
changes with any flipped bit (an odd weight times ``2^k`` is never 0 mod 2^32), and w.h.p. (a
random change passes with probability 2^-32 per layer) with a token moved to another position, a
head or layer moved, K and V exchanged. It guards against corruption and mix-ups, not a forger who
knows the constants (nodes are trusted: Authenticated nodes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

MASK = (1 << 32) - 1  # digests are sums mod 2^32
_SEED = 0x7469657273657276  # "tierserv": the same on every node


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 values, made odd."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))) | np.uint64(1)


def _signed(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x.view(np.int64).copy())


def _signed32(x: np.ndarray) -> torch.Tensor:
    """The low 32 bits (odd, as ``_mix`` made them) as int32."""
    return torch.from_numpy((x & np.uint64(MASK)).astype(np.uint32).view(np.int32))


class DigestWeights:
    """The constants of one model's KV: per layer ``a`` (int32) of shape [2, kv heads, words per
    head], ``b`` (int64) per prompt position; cached per layer and device."""

    def __init__(self, num_kv_heads: int, head_bytes: int, device: torch.device) -> None:
        if head_bytes % 4:
            raise ValueError(f"a KV head of {head_bytes} bytes is not whole 32-bit words")
        self.num_kv_heads, self.words, self.device = num_kv_heads, head_bytes // 4, device
        self._layers: dict[int, torch.Tensor] = {}

    def heads(self, layer: int) -> torch.Tensor:
        """``a`` of the model's layer ``layer``: int32 [2, kv heads, words]."""
        if layer not in self._layers:
            n = 2 * self.num_kv_heads * self.words
            index = np.arange(n, dtype=np.uint64) + np.uint64((layer + 1) << 40) + np.uint64(_SEED)
            self._layers[layer] = _signed32(_mix(index)).view(2, self.num_kv_heads, self.words).to(self.device)
        return self._layers[layer]

    def positions(self, positions: np.ndarray) -> torch.Tensor:
        """``b`` of prompt positions: int64 [len(positions)]."""
        index = positions.astype(np.uint64) ^ np.uint64(_SEED >> 1)
        return _signed(_mix(index)).to(self.device)


def slots_of(pages: Sequence[int | None], start: int, end: int, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots and prompt positions of tokens ``[start, end)`` through the page table ``pages``;
    a page None is not this rank's (context parallelism: another rank sends it) and is left out."""
    tokens = np.arange(start, end, dtype=np.int64)
    used = pages[start // page_size : (end - 1) // page_size + 1] if end > start else []
    table = np.array([-1 if p is None else p for p in used], dtype=np.int64)
    page = table[tokens // page_size - start // page_size] if len(tokens) else tokens
    keep = page >= 0
    return page[keep] * page_size + tokens[keep] % page_size, tokens[keep]


def layer_digest(layer_kv: torch.Tensor, weights: DigestWeights, layer: int, slots: np.ndarray,
                 positions: np.ndarray | torch.Tensor, heads: tuple[int, int, int]) -> torch.Tensor:
    """The digest (an int64 tensor of one element, left on the device: reading it would wait for
    the kernels) of heads ``heads`` = (first local head, count, the model's index of the first)
    at ``slots`` of ``layer_kv`` [2, slots, local heads, head_dim], the model's layer ``layer``."""
    lo, count, model_lo = heads
    if not len(slots) or not count:
        return torch.zeros((), dtype=torch.int64, device=layer_kv.device)
    x = _gathered(layer_kv[:, :, lo:lo + count], slots).view(torch.int32).flatten(2)  # [2, T, h x words]
    a = weights.heads(layer)[:, model_lo:model_lo + count].flatten(1)
    b = positions if isinstance(positions, torch.Tensor) else weights.positions(positions)
    return (token_sums(x, a) * b).sum()


def _gathered(kv: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
    """``kv[:, slots]``: a view when the slots are one run (pages allocated together usually are)."""
    first = int(slots[0])
    if int(slots[-1]) - first + 1 == len(slots) and (len(slots) < 3 or bool((np.diff(slots) == 1).all())):
        return kv[:, first:first + len(slots)]
    return kv.index_select(1, torch.from_numpy(slots).to(kv.device))


def token_sums(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Per token, the sum over K and V of ``x @ a`` (int64, only its value mod 2^32 counts). On CPU
    an int32 matrix-vector product (it wraps mod 2^32: all the digest keeps); CUDA has no integer
    matmul, so a product and a sum there (its reductions are fast)."""
    if x.device.type == "cpu":
        return (x[0] @ a[0]).long() + (x[1] @ a[1]).long()
    return (x * a.unsqueeze(1)).sum(dim=(0, 2), dtype=torch.int64)


def as_unsigned(values: torch.Tensor) -> list[int]:
    """Digests as the proto carries them (fixed64)."""
    return [v & MASK for v in values.tolist()]


class SendDigests:
    """A sender rank's running digests of one handoff, one per model layer, then per draft layer
    (``receive_check.digest_layers``; zero where it sends nothing): ``add`` on the engine thread as
    layers are written, ``values`` once all were."""

    def __init__(self, buffer: torch.Tensor, weights: DigestWeights, heads: tuple[int, int], first_layer: int,
                 num_layers: int) -> None:
        """``buffer``: the rank's pool [layers, 2, slots, heads, dim] (the target's, or a sidecar draft's),
        its arena layer 0 being the digests' ``first_layer`` and its head 0 the model's ``heads[0]``;
        ``heads[1]``: bytes per head."""
        self.buffer, self.weights, self.first_layer = buffer, weights, first_layer
        self.held_start, self.head_bytes = heads
        self.sums = torch.zeros(num_layers, dtype=torch.int64, device=buffer.device)
        self._tokens: tuple[tuple, np.ndarray, torch.Tensor] | None = None  # the last chunk's

    def add(self, layer: int, spans: list[tuple[int, int]], pages: Sequence[int | None], start: int, end: int,
            page_size: int) -> None:
        """Tokens ``[start, end)`` of arena layer ``layer`` sent as the byte spans (offset, length)
        of each slot that its routes take (``Route.src_offset``, ``Route.nbytes``)."""
        slots, b = self._slots(pages, start, end, page_size)
        model_layer = self.first_layer + layer
        for offset, length in spans:
            lo, count = offset // self.head_bytes, length // self.head_bytes
            heads = (lo, count, self.held_start + lo)
            self.sums[model_layer] += layer_digest(self.buffer[layer], self.weights, model_layer, slots, b, heads)

    def _slots(self, pages: Sequence[int | None], start: int, end: int, page_size: int
               ) -> tuple[np.ndarray, torch.Tensor]:
        """Slots and position weights of a chunk, computed once for all its layers (same pages)."""
        key = (start, end, tuple(pages[start // page_size: (end - 1) // page_size + 1]))  # CP: owners' pages differ
        if self._tokens is None or self._tokens[0] != key:
            slots, positions = slots_of(pages, start, end, page_size)
            self._tokens = (key, slots, self.weights.positions(positions))
        return self._tokens[1], self._tokens[2]

    def values(self) -> list[int]:
        return as_unsigned(self.sums)
