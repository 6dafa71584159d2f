"""Between protobuf messages of the control plane and the engine's own types."""

from __future__ import annotations

from tierserve.engine.engine import Engine
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto.sampling import from_proto as sampling_params
from tierserve.transfer.layout import HeadRange, KVArena, RankArena

__all__ = ["arena", "destination_arena", "destination_ranks", "heads_problem", "identity", "identity_mismatch",
           "kv_ranks", "sampling_params"]


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


def kv_ranks(arenas: list[RankArena]) -> list[pb.KVRank]:
    """A node's ranks as the ``KVDestination`` names them."""
    return [pb.KVRank(transfer_endpoint=a.endpoint, base_address=a.arena.base, num_slots=a.arena.num_slots,
                      kv_head_start=a.heads.start, kv_heads=a.heads.count) for a in arenas]


def destination_ranks(dest: pb.KVDestination, head_bytes: int) -> list[RankArena]:
    """Every rank of the destination, with its arena and heads; a destination that names no ranks
    is one rank holding every KV head (the top-level fields)."""
    i = dest.identity
    if not dest.ranks:
        whole = KVArena(dest.base_address, i.num_layers, dest.num_slots, i.num_kv_heads * head_bytes, i.page_size)
        return [RankArena(dest.transfer_endpoint, whole, HeadRange(0, i.num_kv_heads))]
    return [RankArena(r.transfer_endpoint, KVArena(r.base_address, i.num_layers, r.num_slots, r.kv_heads * head_bytes,
                                                   i.page_size), HeadRange(r.kv_head_start, r.kv_heads))
            for r in dest.ranks]


def heads_problem(dests: list[RankArena], num_kv_heads: int, max_page: int) -> str | None:
    """Why a prefill node cannot write into these destination ranks, as a sentence, or None: every
    KV head of the model needs a rank that holds it, and every rank the whole page table."""
    for rank, dest in enumerate(dests):
        problem = _rank_problem(dest, num_kv_heads, max_page)
        if problem is not None:
            return f"destination rank {rank}: {problem}"
    missing = sorted(set(range(num_kv_heads)) - {h for d in dests for h in range(d.heads.start, d.heads.end)})
    if missing:
        return (f"the destination's {len(dests)} rank(s) hold no copy of KV heads {missing} of {num_kv_heads}: "
                "this prefill-decode pairing cannot hand the KV over")
    return None


def _rank_problem(dest: RankArena, num_kv_heads: int, max_page: int) -> str | None:
    if dest.heads.count < 1 or dest.heads.end > num_kv_heads:
        return f"holds KV heads [{dest.heads.start}, {dest.heads.end}) of a model with {num_kv_heads}"
    if not dest.endpoint:
        return "names no transfer endpoint"
    if (max_page + 1) * dest.arena.page_size > dest.arena.num_slots:
        return "a destination page lies outside its arena"
    return None
