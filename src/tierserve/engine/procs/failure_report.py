"""A rank of 1..N-1 that fails tells rank 0 why before it exits, through the node's rendezvous store, so
the message rank 0 stops the node with names the error, not only a rank's exit status (``docs/ranks.md``,
rank failure)."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch.distributed as dist

from tierserve.engine.procs.ranks import HOST, RankSpec

REPORT_TIMEOUT_S = 5.0  # a failing rank waits at most this long for the store (rank 0 may be gone)
MAX_CHARS = 2000


class CommandMismatch(RuntimeError):
    """A command of rank 0's failed on this rank and not on rank 0, or the other way round: the
    ranks' engines are no longer the same."""


def report_failure(spec: RankSpec, error: BaseException) -> None:
    """Leaves ``error`` for rank 0 in the store; best effort: with rank 0 gone there is nobody to tell."""
    with contextlib.suppress(Exception):
        store = dist.TCPStore(HOST, spec.store_port, is_master=False, timeout=timedelta(seconds=REPORT_TIMEOUT_S))
        store.set(_key(spec.rank), f"{type(error).__name__}: {error}"[:MAX_CHARS])


def reported_failures(store: dist.Store, size: int) -> list[str]:
    """What ranks 1..``size``-1 reported (``rank N: error``), read from rank 0's store without waiting."""
    found = []
    for rank in range(1, size):
        with contextlib.suppress(Exception):
            if store.check([_key(rank)]):
                found.append(f"rank {rank}: {store.get(_key(rank)).decode(errors='replace')}")
    return found


def _key(rank: int) -> str:
    return f"failed/{rank}"
