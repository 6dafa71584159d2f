"""Between protobuf messages of the control plane and the engine's own types."""

from __future__ import annotations

from collections.abc import Sequence

from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.engine.engine import Engine
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto.sampling import from_proto as sampling_params
from tierserve.transfer.layout import HeadRange, KVArena, RankArena, StagedPart, staged_slots
from tierserve.transfer.receive_staging import staged_heads

__all__ = ["arena", "destination_arena", "destination_draft", "destination_ranks", "draft_arena", "draft_message",
           "heads_problem", "identity", "identity_mismatch", "kv_ranks", "sampling_params", "sidecar_problem",
           "staging_problem"]


def identity(engine: Engine) -> pb.KVIdentity:
    """What two nodes must share to exchange KV. With a packed draft (docs/speculative.md, PD) its layers are more
    layers of every page and the model names the draft too, so a node with another draft, or none, is refused."""
    ns = engine.namespace
    packed = engine.pool.geometry.num_layers - engine.geometry.num_layers
    model = f"{ns.model}+draft:{ns.draft}" if ns.draft else ns.model
    return pb.KVIdentity(model=model, dtype=ns.kv_dtype, page_size=ns.page_size, num_layers=ns.num_layers + packed,
                         num_kv_heads=ns.num_kv_heads, head_dim=ns.head_dim)


def identity_mismatch(mine: pb.KVIdentity, theirs: pb.KVIdentity) -> str | None:
    """Which fields differ, as a sentence, or None when the two may exchange KV."""
    diffs = [f"{f.name} {getattr(mine, f.name)!r} here vs {getattr(theirs, f.name)!r} there"
             for f in pb.KVIdentity.DESCRIPTOR.fields if getattr(mine, f.name) != getattr(theirs, f.name)]
    return "KV identity mismatch: " + "; ".join(diffs) if diffs else None


def arena(engine: Engine) -> KVArena:
    """The engine's device pool as a transfer arena (a packed draft's layers included)."""
    return _pool_arena(engine.pool)


def draft_arena(engine: Engine) -> KVArena | None:
    """A sidecar draft's device pool as a transfer arena; None without one (no draft, or packed)."""
    return _pool_arena(engine.draft_pool) if engine.draft_pool is not None else None


def _pool_arena(pool: DeviceKVPool) -> KVArena:
    g = pool.geometry
    return KVArena(pool.buffer.data_ptr(), g.num_layers, pool.num_pages * g.page_size,
                   g.num_kv_heads * g.head_dim * g.dtype.itemsize, g.page_size)


def draft_message(engine: Engine) -> pb.KVDraftArena | None:
    """The ``KVDestination.draft`` a decode node names: its sidecar draft pool, if it has one."""
    pool = engine.draft_pool
    if pool is None:
        return None
    g = pool.geometry
    return pb.KVDraftArena(base_address=pool.buffer.data_ptr(), num_slots=pool.num_pages * g.page_size,
                           num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim)


def sidecar_problem(dest: pb.KVDestination, mine: KVGeometry | None) -> str | None:
    """Why a prefill node whose sidecar draft pool is shaped ``mine`` (None: none) cannot hand its
    draft's KV into ``dest``, or None: both sides have such a pool, shaped alike, holding every page."""
    if not dest.HasField("draft"):
        return None if mine is None else "the destination names no draft pool for this node's sidecar draft"
    d = dest.draft
    if mine is None:
        return "the destination names a sidecar draft pool, this node has none"
    if (d.num_layers, d.num_kv_heads, d.head_dim) != (mine.num_layers, mine.num_kv_heads, mine.head_dim):
        return (f"the destination's draft pool holds {d.num_layers} layers x {d.num_kv_heads} KV heads x "
                f"{d.head_dim}, this node's draft {mine.num_layers} x {mine.num_kv_heads} x {mine.head_dim}")
    if dest.pages and (max(dest.pages) + 1) * mine.page_size > d.num_slots:
        return "a destination page lies outside its draft pool"
    return None


def destination_draft(dest: pb.KVDestination, mine: KVGeometry | None) -> RankArena | None:
    """The destination's sidecar draft pool as a rank holding every draft KV head, at the
    destination's endpoint (checked by ``sidecar_problem``); None when it names none."""
    if mine is None or not dest.HasField("draft"):
        return None
    d = dest.draft
    slot_bytes = d.num_kv_heads * d.head_dim * mine.dtype.itemsize
    pool = KVArena(d.base_address, d.num_layers, d.num_slots, slot_bytes, mine.page_size)
    return RankArena(dest.transfer_endpoint, pool, HeadRange(0, d.num_kv_heads))


def destination_arena(dest: pb.KVDestination, slot_bytes: int) -> KVArena:
    i = dest.identity
    return KVArena(dest.base_address, i.num_layers, dest.num_slots, slot_bytes, i.page_size)


def kv_ranks(arenas: list[RankArena]) -> list[pb.KVRank]:
    """A node's ranks as the ``KVDestination`` names them (with the staged parts of one request)."""
    return [pb.KVRank(transfer_endpoint=a.endpoint, base_address=a.arena.base, num_slots=a.arena.num_slots,
                      kv_head_start=a.heads.start, kv_heads=a.heads.count,
                      staged=[pb.KVStagedPart(kv_head_start=s.heads.start, kv_heads=s.heads.count,
                                              address=s.arena.base, tokens=s.arena.num_slots) for s in a.staged],
                      layer_start=a.first_layer, num_layers=a.arena.num_layers, cp_rank=a.owner.rank,
                      cp_size=a.owner.size)
            for a in arenas]


def destination_ranks(dest: pb.KVDestination, head_bytes: int) -> list[RankArena]:
    """Every rank of the destination, with its arena and heads; a destination that names no ranks
    is one rank holding every KV head (the top-level fields)."""
    i = dest.identity
    if not dest.ranks:
        whole = KVArena(dest.base_address, i.num_layers, dest.num_slots, i.num_kv_heads * head_bytes, i.page_size)
        return [RankArena(dest.transfer_endpoint, whole, HeadRange(0, i.num_kv_heads))]
    return [_rank_arena(r, i, head_bytes) for r in dest.ranks]


def _rank_arena(r: pb.KVRank, i: pb.KVIdentity, head_bytes: int) -> RankArena:
    """A destination rank; ``num_layers`` 0 (a node without stages): every layer of the model;
    ``cp_size`` 0 (a node without context parallelism): every page."""
    layers = r.num_layers or i.num_layers
    arena = KVArena(r.base_address, layers, r.num_slots, r.kv_heads * head_bytes, i.page_size)
    staged = tuple(_staged_part(s, layers, i.page_size, head_bytes) for s in r.staged)
    owner = PageOwnership(r.cp_rank, r.cp_size or 1)
    return RankArena(r.transfer_endpoint, arena, HeadRange(r.kv_head_start, r.kv_heads), staged, 0, r.layer_start,
                     owner)


def _staged_part(part: pb.KVStagedPart, layers: int, page_size: int, head_bytes: int) -> StagedPart:
    """Staging is shaped by the layers its rank holds."""
    arena = KVArena(part.address, layers, part.tokens, part.kv_heads * head_bytes, page_size)
    return StagedPart(HeadRange(part.kv_head_start, part.kv_heads), arena)


def heads_problem(dests: list[RankArena], num_kv_heads: int, max_page: int, num_layers: int) -> str | None:
    """Why a prefill node cannot write into these destination ranks, as a sentence, or None: every
    KV head of every layer of the model needs a rank that holds it (under context parallelism, one
    of every CP rank: each holds its own pages), and every rank its pages of the page table."""
    for rank, dest in enumerate(dests):
        problem = _rank_problem(dest, num_kv_heads, max_page, num_layers)
        if problem is not None:
            return f"destination rank {rank}: {problem}"
    sizes = {d.owner.size for d in dests}
    if len(sizes) != 1 or any(not 0 <= d.owner.rank < d.owner.size for d in dests):
        return f"the destination's ranks name inconsistent context-parallel places {[d.owner for d in dests]}"
    for cp in range(sizes.pop()):
        owners = [d for d in dests if d.owner.rank == cp]
        missing = sorted(set(range(num_kv_heads)) - {h for d in owners for h in range(d.heads.start, d.heads.end)})
        if missing:
            return (f"the destination's {len(dests)} rank(s) hold no copy of KV heads {missing} of {num_kv_heads}"
                    f"{f' on CP rank {cp}' if len(owners) < len(dests) else ''}: "
                    "this prefill-decode pairing cannot hand the KV over")
        if (problem := _layers_problem(owners, num_kv_heads, num_layers)) is not None:
            return problem
    return None


def _layers_problem(dests: list[RankArena], num_kv_heads: int, num_layers: int) -> str | None:
    """A KV head some layers of which no destination rank holds (pipeline stages that leave a gap)."""
    for head in range(num_kv_heads):
        held = {layer for d in dests if d.heads.start <= head < d.heads.end
                for layer in range(d.first_layer, d.layers.end)}
        missing = sorted(set(range(num_layers)) - held)
        if missing:
            return (f"none of the destination's {len(dests)} rank(s) holds layers {missing} of {num_layers} "
                    f"of KV head {head}: this prefill-decode pairing cannot hand the KV over")
    return None


def _rank_problem(dest: RankArena, num_kv_heads: int, max_page: int, num_layers: int) -> str | None:
    if dest.heads.count < 1 or dest.heads.end > num_kv_heads:
        return f"holds KV heads [{dest.heads.start}, {dest.heads.end}) of a model with {num_kv_heads}"
    if dest.arena.num_layers < 1 or dest.layers.end > num_layers:
        return f"holds layers [{dest.first_layer}, {dest.layers.end}) of a model with {num_layers}"
    if not dest.endpoint:
        return "names no transfer endpoint"
    if (dest.owner.local(max_page) + 1) * dest.arena.page_size > dest.arena.num_slots:
        return "a destination page lies outside its arena"
    return None


def staging_problem(dests: list[RankArena], num_kv_heads: int, tp_size: int, prompt_len: int,
                    pages: Sequence[int]) -> str | None:
    """Why this prefill node (``tp_size`` ranks) cannot use the staging the destination offers, or
    None: it must be exactly for this node's ranks' heads (the decode rank scatters every part it
    offered, so a part nobody writes would overwrite the pages), each large enough for the prompt
    (under CP: for the rank's pages of it, ``staged_slots``, of the page table ``pages``)."""
    for rank, dest in enumerate(dests):
        offered = [s.heads for s in dest.staged]
        if offered and offered != staged_heads(dest.heads, tp_size, num_kv_heads):
            return (f"destination rank {rank} staged KV heads {[(h.start, h.count) for h in offered]} for "
                    f"another prefill TP size than this node's {tp_size}: reserve again naming it")
        needed = staged_slots(dest.owner, pages, prompt_len, dest.arena.page_size)
        if any(s.arena.num_slots < needed for s in dest.staged):
            return f"destination rank {rank} staged fewer tokens than the prompt's {needed} it holds"
    return None
