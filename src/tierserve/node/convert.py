"""Between protobuf messages of the control plane and the engine's own types."""

from __future__ import annotations

from collections.abc import Sequence

from tierserve.cache.device_pool import DeviceKVPool
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.engine.engine import Engine
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto.sampling import from_proto as sampling_params
from tierserve.transfer.layout import EVERY_PAGE, HeadRange, KVArena, RankArena, StagedPart, staged_slots
from tierserve.transfer.receive_staging import staged_heads

__all__ = ["arena", "destination_arena", "destination_ranks", "draft_arena", "draft_message", "draft_rank",
           "heads_problem", "identity", "identity_mismatch", "kv_ranks", "sampling_params", "sidecar_problem",
           "staging_problem"]


def identity(engine: Engine) -> pb.KVIdentity:
    """What two nodes must share to exchange KV. With a packed draft (docs/speculative.md, PD) its layers are more
    layers of every page and the model names the draft too, so a node with another draft, or none, is refused.
    Counted from the draft's plan: under pipeline stages only the last stage's pools hold them, not rank 0's."""
    ns = engine.namespace
    packed = engine.draft.packed_layers if engine.draft is not None else 0
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


def draft_rank(engine: Engine, endpoint: str) -> RankArena | None:
    """The engine's sidecar draft pool as a rank at ``endpoint`` holding this rank's draft KV heads
    (a draft model's share, split like the target; an EAGLE head's every one, replicated); None
    without one (no draft, a packed one, a pipeline stage without the draft)."""
    pool = draft_arena(engine)
    if pool is None or engine.draft is None:
        return None
    heads = HeadRange(engine.draft.heads.start, engine.draft.heads.count)
    return RankArena(endpoint, pool, heads, owner=engine.ranks.cp)


def draft_message(draft: RankArena | None, itemsize: int) -> pb.KVDraftArena | None:
    """A rank's sidecar draft pool as the ``KVDestination`` names it (``itemsize``: the KV dtype's bytes)."""
    if draft is None:
        return None
    a, heads = draft.arena, draft.heads
    return pb.KVDraftArena(base_address=a.base, num_slots=a.num_slots, num_layers=a.num_layers,
                           num_kv_heads=heads.count, head_dim=a.slot_bytes // heads.count // itemsize,
                           kv_head_start=heads.start)


def _draft_of(m: pb.KVDraftArena, endpoint: str, itemsize: int, page_size: int,
              owner: PageOwnership = EVERY_PAGE) -> RankArena:
    """A rank's draft pool, holding the pages its rank holds (``owner``: a CP rank's own, at local slots)."""
    pool = KVArena(m.base_address, m.num_layers, m.num_slots, m.num_kv_heads * m.head_dim * itemsize, page_size)
    return RankArena(endpoint, pool, HeadRange(m.kv_head_start, m.num_kv_heads), owner=owner)


def sidecar_problem(theirs: list[RankArena], mine: list[RankArena], max_page: int) -> str | None:
    """Why a prefill node whose ranks hold the sidecar draft pools ``mine`` cannot hand its draft's
    KV into the destination ranks' pools ``theirs`` (up to page ``max_page``), or None: both or
    neither have such pools, shaped alike (layers, bytes per head), and the destination's ranks hold
    exactly the draft KV heads this node's do (each wherever it likes: they map as the target's do;
    under context parallelism, the ranks of every CP place: each holds its own pages)."""
    if not mine:
        return "the destination names a sidecar draft pool, this node has none" if theirs else None
    if not theirs:
        return "the destination names no draft pool for this node's sidecar draft"
    for rank, d in enumerate(theirs):
        problem = _draft_pool_problem(d, mine[0], max_page)
        if problem is not None:
            return f"the destination's draft pool {rank}: {problem}"
    needed = _draft_heads(mine)
    for cp in range(theirs[0].owner.size):  # under context parallelism each CP rank holds its own pages
        owners = [d for d in theirs if d.owner.rank == cp]
        held = _draft_heads(owners)
        if held != needed:
            where = f" on CP rank {cp}" if len(owners) < len(theirs) else ""
            return (f"the destination's draft pools hold draft KV heads {sorted(held)}{where}, this node's "
                    f"{sorted(needed)}: this prefill-decode pairing cannot hand the draft's KV over")
    return None


def _draft_pool_problem(theirs: RankArena, mine: RankArena, max_page: int) -> str | None:
    shapes = [(d.arena.num_layers, d.arena.slot_bytes // d.heads.count) for d in (theirs, mine)]
    if shapes[0] != shapes[1]:
        return (f"{shapes[0][0]} layers x {shapes[0][1]} bytes a KV head, this node's draft "
                f"{shapes[1][0]} x {shapes[1][1]}")
    if (theirs.owner.local(max_page) + 1) * theirs.arena.page_size > theirs.arena.num_slots:
        return "a destination page lies outside it"
    return None


def _draft_heads(drafts: list[RankArena]) -> set[int]:
    return {h for d in drafts for h in range(d.heads.start, d.heads.end)}


def destination_arena(dest: pb.KVDestination, slot_bytes: int) -> KVArena:
    i = dest.identity
    return KVArena(dest.base_address, i.num_layers, dest.num_slots, slot_bytes, i.page_size)


def kv_ranks(arenas: list[RankArena], itemsize: int) -> list[pb.KVRank]:
    """A node's ranks as the ``KVDestination`` names them (with the staged parts of one request and
    their sidecar draft pools; ``itemsize``: the KV dtype's bytes)."""
    return [pb.KVRank(transfer_endpoint=a.endpoint, base_address=a.arena.base, num_slots=a.arena.num_slots,
                      kv_head_start=a.heads.start, kv_heads=a.heads.count,
                      staged=[pb.KVStagedPart(kv_head_start=s.heads.start, kv_heads=s.heads.count,
                                              address=s.arena.base, tokens=s.arena.num_slots) for s in a.staged],
                      layer_start=a.first_layer, num_layers=a.arena.num_layers, cp_rank=a.owner.rank,
                      cp_size=a.owner.size, draft=draft_message(a.draft, itemsize))
            for a in arenas]


def destination_ranks(dest: pb.KVDestination, head_bytes: int) -> list[RankArena]:
    """Every rank of the destination, with its arena and heads; a destination that names no ranks
    is one rank holding every KV head (the top-level fields)."""
    i = dest.identity
    if not dest.ranks:
        whole = KVArena(dest.base_address, i.num_layers, dest.num_slots, i.num_kv_heads * head_bytes, i.page_size)
        draft = _draft_of(dest.draft, dest.transfer_endpoint, head_bytes // i.head_dim, i.page_size) \
            if dest.HasField("draft") else None
        return [RankArena(dest.transfer_endpoint, whole, HeadRange(0, i.num_kv_heads), draft=draft)]
    return [_rank_arena(r, i, head_bytes) for r in dest.ranks]


def _rank_arena(r: pb.KVRank, i: pb.KVIdentity, head_bytes: int) -> RankArena:
    """A destination rank; ``num_layers`` 0 (a node without stages): every layer of the model;
    ``cp_size`` 0 (a node without context parallelism): every page."""
    layers = r.num_layers or i.num_layers
    arena = KVArena(r.base_address, layers, r.num_slots, r.kv_heads * head_bytes, i.page_size)
    staged = tuple(_staged_part(s, layers, i.page_size, head_bytes) for s in r.staged)
    owner = PageOwnership(r.cp_rank, r.cp_size or 1)
    draft = _draft_of(r.draft, r.transfer_endpoint, head_bytes // i.head_dim, i.page_size, owner) \
        if r.HasField("draft") else None
    return RankArena(r.transfer_endpoint, arena, HeadRange(r.kv_head_start, r.kv_heads), staged, 0, r.layer_start,
                     owner, draft)


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
