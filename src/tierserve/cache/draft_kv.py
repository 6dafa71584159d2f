"""A speculative draft's KV in the sidecar layout: its own device and host pools beside the
target's, whose copies take their page indexes from the target's (docs/speculative.md, draft KV in the cache).

Device page p of the draft pool belongs with device page p of the target pool, host page h of the
draft's host pool with host page h of the target's, so every L1 <-> L2 copy of target pages moves
the same draft pages, and a layer-wise load numbers the draft's layers after the target's: its
completion events cover the draft copies. In L3 a page's draft rows are their own object under
``draft_key`` of the page key. (The packed layout needs none of this: the draft's layers are
more layers of the target's pools, so every copy and object holds both.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from tierserve.cache.device_pool import DeviceKVPool
from tierserve.cache.host_pool import HostKVPool
from tierserve.cache.sharded.shards import Source
from tierserve.cache.staging import page_io
from tierserve.cache.storage import StorageBackend


@dataclass(frozen=True)
class SidecarKV:
    """The draft's pools: ``device`` has the target pool's page count, ``host`` the target host
    pool's (and its layout)."""

    device: DeviceKVPool
    host: HostKVPool

    @classmethod
    def beside(cls, draft: DeviceKVPool, target_host: HostKVPool, pin_memory: bool) -> SidecarKV:
        return cls(draft, HostKVPool(draft.geometry, target_host.num_pages, target_host.layout, pin_memory))


def load_layers(target: DeviceKVPool, sidecar: SidecarKV | None) -> int:
    """Layers of a layer-wise load: the target's, then the sidecar draft's."""
    return target.geometry.num_layers + (sidecar.device.geometry.num_layers if sidecar else 0)


def planes(target: DeviceKVPool, host: HostKVPool, sidecar: SidecarKV | None, layers: range | None = None
           ) -> list[tuple[DeviceKVPool, HostKVPool, range | None]]:
    """The (device pool, host pool, layers) copies that move ``layers`` of a page in load numbering
    (``load_layers``; all of both when None): the target's, and the sidecar draft's same pages."""
    n = target.geometry.num_layers
    out = []
    if layers is None or layers.start < n:
        out.append((target, host, layers))
    if sidecar is not None and (layers is None or layers.start >= n):
        out.append((sidecar.device, sidecar.host, None if layers is None else range(layers.start - n, layers.stop - n)))
    return out


def draft_key(page_key: bytes) -> bytes:
    """The L3 key of a page's draft rows in the sidecar layout."""
    return hashlib.sha256(b"draft:" + page_key).digest()


class SidecarIO:
    """The L3 side of a sidecar: wraps the target's ``ShardIO`` so that every page is stored, found
    and read only together with its draft object (a page is present when both are)."""

    def __init__(self, target, host: HostKVPool, storage: StorageBackend) -> None:
        self.target, self.draft = target, page_io(host)
        self.own = target.own
        storage.attach_host_buffer(self.draft.buffer)

    @property
    def buffer(self) -> torch.Tensor:
        return self.target.buffer

    def probe(self, storage: StorageBackend, page_keys: list[bytes]) -> tuple[int, Source]:
        n, source = self.target.probe(storage, page_keys)
        return min(n, storage.batch_exists([draft_key(k) for k in page_keys[:n]])), source

    def exists(self, storage: StorageBackend, page_keys: list[bytes]) -> int:
        n = self.target.exists(storage, page_keys)
        return min(n, storage.batch_exists([draft_key(k) for k in page_keys[:n]]))

    def set_from(self, storage: StorageBackend, page_keys: list[bytes], host_pages: list[int]) -> list[bool]:
        ok = self.target.set_from(storage, page_keys, host_pages)
        drafts = self.draft.set_from(storage, [draft_key(k) for k in page_keys], host_pages)
        return [a and b for a, b in zip(ok, drafts, strict=True)]

    def get_into(self, storage: StorageBackend, source: Source, page_keys: list[bytes],
                 host_pages: list[int]) -> list[bool]:
        ok = self.target.get_into(storage, source, page_keys, host_pages)
        drafts = self.draft.get_into(storage, [draft_key(k) for k in page_keys], host_pages)
        return [a and b for a, b in zip(ok, drafts, strict=True)]
