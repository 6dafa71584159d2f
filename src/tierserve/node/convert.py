"""Between protobuf messages of the control plane and the engine's own types."""

from __future__ import annotations

from tierserve.engine.engine import Engine
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto.sampling import from_proto as sampling_params
from tierserve.transfer.layout import KVArena

__all__ = ["arena", "destination_arena", "identity", "identity_mismatch", "sampling_params"]


def identity(engine: Engine) -> pb.KVIdentity:
    ns = engine.namespace
    return pb.KVIdentity(model=ns.model, dtype=ns.kv_dtype, page_size=ns.page_size, num_layers=ns.num_layers,
                         num_kv_heads=ns.num_kv_heads, head_dim=ns.head_dim)


def identity_mismatch(mine: pb.KVIdentity, theirs: pb.KVIdentity) -> str | None:
    """Which fields differ, as a sentence, or None when the two may exchange KV."""
    diffs = [f"{f.name} {getattr(mine, f.name)!r} here vs {getattr(theirs, f.name)!r} there"
             for f in pb.KVIdentity.DESCRIPTOR.fields if getattr(mine, f.name) != getattr(theirs, f.name)]
    return "KV identity mismatch: " + "; ".join(diffs) if diffs else None


def arena(engine: Engine) -> KVArena:
    """The engine's device pool as a transfer arena."""
    pool, g = engine.pool, engine.geometry
    return KVArena(pool.buffer.data_ptr(), g.num_layers, pool.num_pages * g.page_size,
                   g.num_kv_heads * g.head_dim * g.dtype.itemsize, g.page_size)


def destination_arena(dest: pb.KVDestination, slot_bytes: int) -> KVArena:
    i = dest.identity
    return KVArena(dest.base_address, i.num_layers, dest.num_slots, slot_bytes, i.page_size)
