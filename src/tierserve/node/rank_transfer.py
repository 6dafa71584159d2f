"""Each rank's transfer side of a prefill or decode node (``docs/ranks.md``): its own
transfer engine and KV arena, which holds only the rank's KV heads. Every rank starts it right
after its engine (``NodeRankRole.attach``) and the ranks gather every rank's arena, so rank 0 can
name them all in a ``KVDestination`` (decode) and every prefill rank knows its heads' routes. With
pipeline stages a rank's arena holds its stage's layers only, and says which (``RankArena.first_layer``):
each prefill rank sends its heads of its layers to the decode ranks holding those layers. With context
parallelism a rank's arena holds the pages it owns: each CP prefill rank sends those, and each CP decode
rank says which it holds (``RankArena.owner``), so every page goes to its owner (``docs/cp.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from tierserve.core.transfer import TransferProtocol
from tierserve.engine.commands import AddRequest, Bind, EngineCall, EngineCommand
from tierserve.engine.engine import Engine
from tierserve.node.convert import arena, draft_arena, draft_rank
from tierserve.node.handoffs import AgreedHandoff, HandoffAdd, HandoffBoard
from tierserve.transfer.digest import SendDigests
from tierserve.transfer.engine import PeerEngines, TransferEngineHandle
from tierserve.transfer.faulty import NO_FAULTS, HandoffFaults, with_faults
from tierserve.transfer.handoff import KVHandoff
from tierserve.transfer.layout import HeadRange, LayerRange, RankArena, plan_routes
from tierserve.transfer.receive_check import DigestedPool, digest_layers, draft_pool, target_pool
from tierserve.transfer.receive_staging import ReceiveStaging
from tierserve.transfer.sender import SenderHandoff
from tierserve.transfer.sidecar import SidecarHandoff
from tierserve.transfer.staging import Gatherer, StagingArena


class Side(Enum):
    """Which end of a handoff a node's ranks are: decode ranks receive, prefill ranks send."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class TransferOptions:
    """How a rank's transfer engines reach peers."""

    hostname: str = "127.0.0.1"
    protocol: TransferProtocol = TransferProtocol.TCP
    devices: str = ""
    staging_bytes: int = 64 << 20  # per rank: coalesces handoffs between TP sizes (transfer/staging.py)
    integrity: bool = False  # digests of handed-over KV (transfer/digest.py)


@dataclass(frozen=True)
class HandoffPlan:
    """What every prefill rank builds its own handoff of one request from (it crosses ranks):
    the destination's ranks (with their sidecar draft pools, if any), page table, tokens it holds
    already, and the prompt's length."""

    dests: tuple[RankArena, ...]
    dst_pages: tuple[int, ...]
    dst_start: int
    prompt_len: int


@dataclass
class RankTransfer:
    """One rank's transfer side: ``receiver`` (decode ranks and rank 0; None on other prefill
    ranks), ``peers`` for sending, ``arenas`` of every rank in rank order, ``board`` of agreed
    handoffs (prefill node of several ranks, else None), ``sends``: the heads this rank hands over
    (None: a replica of a KV head another rank sends); ``draft_sends``: the same for its sidecar
    draft pool's heads (None: none, or another rank sends those rows, e.g. a replicated EAGLE head's)."""

    engine: Engine
    receiver: TransferEngineHandle | None
    peers: PeerEngines
    arenas: list[RankArena]
    board: HandoffBoard | None
    sends: HeadRange | None
    gatherer: Gatherer | None = None
    receive: ReceiveStaging | None = None
    integrity: bool = False  # senders digest what they send (``--handoff-integrity``)
    draft_sends: HeadRange | None = None

    @property
    def head_bytes(self) -> int:
        g = self.engine.geometry
        return g.head_dim * g.dtype.itemsize

    @property
    def layers(self) -> LayerRange:
        """The model's layers this rank's stage holds (its arena's, in order)."""
        return own_layers(self.engine)

    def handoff(self, plan: HandoffPlan, faults: HandoffFaults = NO_FAULTS) -> SenderHandoff:
        """This rank's sender for ``plan`` (``_heads``). With a sidecar draft, its pool's KV as well
        (``transfer/sidecar.py``)."""
        return self._with_draft(self._heads(plan, faults), plan)

    def _heads(self, plan: HandoffPlan, faults: HandoffFaults) -> KVHandoff:
        """The sender of this rank's heads of its stage's layers, to every destination rank that
        holds some of both; under context parallelism, of the pages this rank owns. ``faults``
        (tests only) wrap the peers it submits through (``transfer/faulty.py``)."""
        routes = plan_routes(self.sends, self.head_bytes, list(plan.dests), self.layers) if self.sends else []
        return KVHandoff(with_faults(self.peers, faults), routes, arena(self.engine), list(plan.dst_pages),
                         plan.dst_start, plan.prompt_len, self.engine.device.type == "cuda", self.gatherer,
                         self.engine.ranks.cp, self._digests(target_pool(self.engine)))

    def _with_draft(self, target: KVHandoff, plan: HandoffPlan) -> SenderHandoff:
        """``target`` paired with a sender of this rank's sidecar draft pool when both nodes have such
        pools (the prefill service checked that they do, or that neither does: ``sidecar_problem``):
        its draft heads go to every destination rank's pool holding some of them, as the target's do
        (whole slots when both hold the same heads); a rank whose rows another sends sends nothing.
        Under context parallelism the draft's pages are owned as the target's: a CP prefill rank sends
        its own pages of the draft pool, each into the decode rank holding that page (``owner``)."""
        source = draft_arena(self.engine)
        theirs = [d.draft for d in plan.dests if d.draft is not None]
        if source is None or not theirs:
            return target
        mine = self.draft_sends
        routes = plan_routes(mine, source.slot_bytes // mine.count, theirs) if mine else []
        draft = KVHandoff(self.peers, routes, source, list(plan.dst_pages), plan.dst_start, plan.prompt_len,
                          cuda=self.engine.device.type == "cuda", owner=self.engine.ranks.cp,
                          digests=self._digests(draft_pool(self.engine)))
        return SidecarHandoff(target, draft, self.engine.geometry.num_layers)

    def agreed(self, plan: HandoffPlan, faults: HandoffFaults = NO_FAULTS) -> AgreedHandoff:
        """This rank's side of the node's sender for ``plan`` (a node of several ranks; with a
        sidecar draft, its pool's part too)."""
        assert self.board is not None, "an agreed handoff needs a node of several ranks"
        return AgreedHandoff(self.handoff(plan, faults), self.board)

    def _digests(self, pool: DigestedPool | None) -> SendDigests | None:
        """The digests of what this rank sends from ``pool`` (its target pool or its sidecar draft's),
        over every digest layer: every rank digests, a replica that sends nothing too (zeros), so
        the node's rows stay alike (``node/handoffs.py`` adds a ``SidecarHandoff``'s parts up)."""
        if not self.integrity or pool is None:
            return None
        heads = (pool.head_start, pool.head_bytes)
        return SendDigests(pool.buffer, pool.weights, heads, pool.first_layer, digest_layers(self.engine))

    def bind(self, command: EngineCommand | EngineCall) -> EngineCommand | EngineCall:
        """A request rank 0 hands over becomes this rank's own handoff of it (``RankRole``)."""
        if isinstance(command, AddRequest) and isinstance(command.plan, HandoffPlan) and self.board is not None:
            return HandoffAdd(command, self.agreed(command.plan))
        return command


@dataclass(frozen=True)
class NodeRankRole:
    """The ``RankRole`` of prefill and decode nodes (picklable: ranks 1..N-1 get it at spawn)."""

    side: Side
    options: TransferOptions

    def attach(self, engine: Engine) -> Bind:
        return self.start(engine).bind

    def start(self, engine: Engine) -> RankTransfer:
        """Every rank, right after its engine, in the same order: starts the rank's engines and
        gathers the ranks' arenas (one collective at several ranks)."""
        shard = engine.kv_shard  # this rank's KV heads; ``writes``: it sends them (first of their replicas)
        o, held = self.options, HeadRange(shard.heads.start, shard.heads.count)
        receiver, receive = self._receiver(engine), self._receive(engine, held)
        gatherer = self._gatherer(engine)
        staged = [gatherer.staging.buffer] if gatherer else []
        peers = PeerEngines(o.hostname, o.protocol, o.devices, [*kv_buffers(engine), *staged])
        if receiver is not None and receive is not None:
            receiver.register(receive.staging.buffer)
        base = receive.staging.base if receive else 0
        endpoint = receiver.endpoint if receiver else ""
        own = RankArena(endpoint, arena(engine), held, (), base, own_layers(engine).start, engine.ranks.cp,
                        draft_rank(engine, endpoint))
        arenas = _gather(engine, own)
        draft_sends = own.draft.heads if own.draft is not None and engine.draft.writes else None
        return RankTransfer(engine, receiver, peers, arenas, self._board(engine), held if shard.writes else None,
                            gatherer, receive, o.integrity, draft_sends)

    def _receive(self, engine: Engine, held: HeadRange) -> ReceiveStaging | None:
        """Decode ranks stage writers that hold fewer heads (``transfer/receive_staging.py``)."""
        if self.side is not Side.DECODE or self.options.staging_bytes <= 0:
            return None
        staging = StagingArena(self.options.staging_bytes, engine.pool.buffer.device)
        # regions sized for every layer (a packed draft's too): any stage's fit, at one offset on every rank
        receive = ReceiveStaging(staging, engine.pool.buffer, arena(engine), held, engine.model_config.num_kv_heads,
                                 engine.ranks.cp, engine.kv_shard.layers.total)
        engine.reservations.staging = receive
        return receive

    def _gatherer(self, engine: Engine) -> Gatherer | None:
        """Prefill ranks stage the heads a destination rank holds fewer of (``transfer/staging.py``)."""
        if self.side is not Side.PREFILL or self.options.staging_bytes <= 0:
            return None
        staging = StagingArena(self.options.staging_bytes, engine.pool.buffer.device)
        return Gatherer(staging, engine.pool.buffer, arena(engine))

    def _receiver(self, engine: Engine) -> TransferEngineHandle | None:
        """Decode ranks receive; rank 0 names the node to peers (``NodeInfo``) whatever its role."""
        if self.side is Side.PREFILL and engine.ranks.rank != 0:
            return None
        o = self.options
        receiver = TransferEngineHandle(o.hostname, o.protocol, o.devices)
        for buffer in kv_buffers(engine):  # the arena (every page, every layer), a sidecar draft's pool
            receiver.register(buffer)
        return receiver

    def _board(self, engine: Engine) -> HandoffBoard | None:
        """A prefill node of several ranks agrees on its handoffs at the start of every step."""
        if engine.ranks.size == 1 or self.side is Side.DECODE:
            return None
        board = HandoffBoard(engine.ranks)
        engine.before_step.append(board.agree)
        return board


def kv_buffers(engine: Engine) -> list[torch.Tensor]:
    """What a rank registers with its transfer engines: its device pool, and a sidecar draft's."""
    return [engine.pool.buffer] if engine.draft_pool is None else [engine.pool.buffer, engine.draft_pool.buffer]


def own_layers(engine: Engine) -> LayerRange:
    """The model's layers the engine's stage holds (every layer without stages; a packed draft's
    layers follow the target's, as in its pool)."""
    layers = engine.ranks.pp.layers(engine.model_config.num_layers)
    return LayerRange(layers.start, len(layers) + engine.pool.geometry.num_layers - engine.geometry.num_layers)


def _gather(engine: Engine, own: RankArena) -> list[RankArena]:
    ranks = engine.ranks
    if ranks.size == 1:
        return [own]
    every: list[RankArena | None] = [None] * ranks.size
    dist.all_gather_object(every, own, group=ranks.control)
    return [a for a in every if a is not None]

