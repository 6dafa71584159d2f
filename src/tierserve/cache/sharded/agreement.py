"""The one point where ranks agree on cache decisions (``docs/ranks.md``).

With several ranks (tensor, context or pipeline parallel), each holds its own share of every page
but all must keep the same tree. Background work (L2 writes, L3 backups, prefetches) finishes at
different times on different ranks, so every decision it feeds is taken on the minimum over the
ranks, in one collective of fixed shape per scheduler step: ranks can never disagree on how many
collectives they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SLOTS = 128  # the fixed length of the agreed vector
NOT_USED = 2**62  # padding: the minimum over ranks ignores it


def leading_true(flags) -> int:
    """How many leading flags are true: a count of finished items that every rank can compare."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n


class Agreement(Protocol):
    def min(self, values: list[int]) -> list[int]:
        """Element-wise minimum of ``values`` over all ranks (same length on every rank)."""
        ...


class SingleRank:
    """One rank: its own values are the agreed ones."""

    def min(self, values: list[int]) -> list[int]:
        return list(values)


class CollectiveMin:
    """``all_reduce(MIN)`` of one int64 tensor of ``SLOTS`` entries per call, over ``group``
    (gloo works on CPU; None: the default group). Callers must call ``min`` the same number of
    times on every rank."""

    def __init__(self, group: ProcessGroup | None = None) -> None:
        self.group = group

    def min(self, values: list[int]) -> list[int]:
        if len(values) > SLOTS:
            raise ValueError(f"{len(values)} values do not fit the agreed vector of {SLOTS}")
        vector = torch.full((SLOTS,), NOT_USED, dtype=torch.int64)
        vector[: len(values)] = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(vector, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return vector[: len(values)].tolist()


def agreed_all(agreement: Agreement, flags: list[bool]) -> list[bool]:
    """Per flag, whether it is true on every rank: one ``min`` per ``SLOTS`` flags, so ranks with
    the same number of flags run the same number of collectives."""
    agreed: list[bool] = []
    for start in range(0, len(flags), SLOTS):
        agreed += [v == 1 for v in agreement.min([int(f) for f in flags[start : start + SLOTS]])]
    return agreed
