"""Run-time L3 control (attach, detach, clear) on every rank of a node at once
(``docs/ranks.md``). Rank 0 publishes the call on the step bus before applying it
(``CollectiveCall``), so every rank runs this at the same point of its command stream, between the
same two steps, and the agreements below line up.

Two phases, each ended by one agreement (an ``all_gather`` over the control group, bounded by its
timeout; none at one rank): first every rank checks it is idle, so an irreversible detach starts on
every rank or on none; then every rank acts. An attach that failed on any rank is undone on the
ranks where it succeeded, so no rank keeps an L3 that another lacks; a detach or clear that failed
on some rank still ran on the others (a detach always drops the tier). Every rank raises the failure
of the lowest rank that failed, so rank 0 reports it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from tierserve.cache.factory import rank_backend
from tierserve.core.storage import StorageAction, StorageAdminError, StorageBusyError, StorageKind

if TYPE_CHECKING:
    from tierserve.engine.engine import Engine

log = logging.getLogger(__name__)


class FailureKind(Enum):
    """What kind of error a rank's failure is re-raised as on every rank."""

    BUSY = "busy"  # StorageBusyError: retry in another state
    INVALID = "invalid"  # ValueError: the request itself is wrong
    FAILED = "failed"  # StorageAdminError: the store or the rank failed


@dataclass(frozen=True)
class RankFailure:
    """One rank's failed phase, as data every rank can receive (pickled)."""

    rank: int
    kind: FailureKind
    message: str

    def error(self, size: int) -> Exception:
        """The exception to raise; above one rank the message names the rank."""
        message = self.message if size == 1 else f"rank {self.rank}: {self.message}"
        return {FailureKind.BUSY: StorageBusyError, FailureKind.INVALID: ValueError,
                FailureKind.FAILED: StorageAdminError}[self.kind](message)


def storage_admin(engine: Engine, action: StorageAction, kind: StorageKind | None, config: dict[str, Any]
                  ) -> dict[str, Any]:
    """Runs ``action`` on this rank in agreement with the others; returns this rank's L3 status.
    Every rank must call it with the same arguments at the same point (an engine call)."""
    if action is StorageAction.STATUS:
        return engine.cache.storage_admin(action)
    failure = _agree(engine, _attempt(engine, lambda: _require_idle(engine)))
    if failure is None:
        mine = _attempt(engine, lambda: _act(engine, action, kind, config))
        failure = _agree(engine, mine)
        if failure is not None and mine is None and action is StorageAction.ATTACH:
            _undo_attach(engine)
    if failure is not None:
        raise failure.error(engine.ranks.size)
    return engine.cache.storage_admin(StorageAction.STATUS)


def _require_idle(engine: Engine) -> None:
    if engine.has_work():
        raise StorageBusyError("requests are running: retry when the engine is idle")


def _act(engine: Engine, action: StorageAction, kind: StorageKind | None, config: dict[str, Any]) -> None:
    if action is not StorageAction.ATTACH:
        engine.cache.storage_admin(action)
        return
    backend = rank_backend(kind or "", config, engine.kv_shard)
    try:
        engine.cache.storage_admin(action, backend)
    except BaseException:
        backend.close()  # never attached: nothing else will close its client
        raise


def _undo_attach(engine: Engine) -> None:
    """Another rank could not attach: this one detaches what it just attached."""
    try:
        engine.cache.storage_admin(StorageAction.DETACH)
    except Exception:
        log.exception("undoing an attach that another rank could not make failed")


def _attempt(engine: Engine, phase: Callable[[], None]) -> RankFailure | None:
    """Runs this rank's ``phase``; its failure as data, None when it succeeded."""
    try:
        phase()
    except StorageBusyError as exc:
        return RankFailure(engine.ranks.rank, FailureKind.BUSY, str(exc))
    except (ValueError, ImportError) as exc:
        return RankFailure(engine.ranks.rank, FailureKind.INVALID, str(exc))
    except Exception as exc:
        log.exception("L3 admin failed on this rank")
        return RankFailure(engine.ranks.rank, FailureKind.FAILED, str(exc) or type(exc).__name__)
    return None


def _agree(engine: Engine, failure: RankFailure | None) -> RankFailure | None:
    """The failure of the lowest rank that failed, the same on every rank (one collective)."""
    return next((f for f in engine.ranks.all_gather(failure) if f is not None), None)
