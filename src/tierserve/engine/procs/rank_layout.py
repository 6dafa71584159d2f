"""Where each rank of a node sits in its TP x CP x PP grid, and which ranks share each group
(``docs/ranks.md``, rank numbering).

A node of ``tp`` T, ``cp`` C and ``pp`` S has T * C * S rank processes; rank
``(stage * C + cp) * T + tp`` is tensor rank ``tp`` of CP rank ``cp`` of stage ``stage``. So the
tensor ranks of one CP rank of one stage are consecutive (their all-reduces are the hottest
collectives), a stage's ranks are a contiguous block, and with C = 1 or S = 1 the numbering is the
one of a TP x PP or a CP node before CP composed. Each group is a list of global ranks, the same
lists on every rank, in the same order (``new_group`` must be called alike everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankPlace:
    """One rank's coordinates: tensor rank ``tp``, CP rank ``cp``, pipeline stage ``stage``."""

    tp: int
    cp: int
    stage: int


@dataclass(frozen=True)
class RankLayout:
    """The grid of a node: ``tp`` tensor ranks per CP rank, ``cp`` CP ranks per stage, ``pp`` stages."""

    tp: int = 1
    cp: int = 1
    pp: int = 1

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp

    def rank(self, place: RankPlace) -> int:
        """The global rank at ``place``."""
        return (place.stage * self.cp + place.cp) * self.tp + place.tp

    def place(self, rank: int) -> RankPlace:
        """The coordinates of global ``rank`` (``ValueError`` outside the node)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a node of {self.size} ranks")
        block, tp = divmod(rank, self.tp)
        stage, cp = divmod(block, self.cp)
        return RankPlace(tp, cp, stage)

    def tensor_groups(self) -> list[list[int]]:
        """The ranks of each (stage, CP rank), in that order: every tensor-parallel all-reduce's group."""
        return [[self.rank(RankPlace(t, c, s)) for t in range(self.tp)] for s in range(self.pp) for c in range(self.cp)]

    def cp_groups(self) -> list[list[int]]:
        """The ranks of each (stage, tensor rank), in that order: the CP ranks that hold the same
        heads of the same layers and share their pages (gathers and merged attention)."""
        return [[self.rank(RankPlace(t, c, s)) for c in range(self.cp)] for s in range(self.pp) for t in range(self.tp)]

    def tensor_group_of(self, rank: int) -> int:
        """The index in ``tensor_groups`` of ``rank``'s group."""
        p = self.place(rank)
        return p.stage * self.cp + p.cp

    def cp_group_of(self, rank: int) -> int:
        """The index in ``cp_groups`` of ``rank``'s group."""
        p = self.place(rank)
        return p.stage * self.tp + p.tp

    @property
    def stage_width(self) -> int:
        """Ranks per stage: the next stage's peer of rank r (same tensor and CP rank) is r + this."""
        return self.tp * self.cp

    @property
    def sampler(self) -> int:
        """The rank that computes logits and samples: tensor rank 0 of CP rank 0 of the last stage."""
        return self.rank(RankPlace(0, 0, self.pp - 1))
