"""Rank 0 tells the other ranks of its node what each engine step applies (``docs/ranks.md``): the commands it took in,
in order, and whether a step runs. One broadcast per loop turn (two when commands came), over the control group."""

from __future__ import annotations

import logging
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntFlag
from typing import Protocol

import torch
import torch.distributed as dist

from tierserve.engine.commands import EngineCall, EngineCommand, for_other_ranks
from tierserve.engine.procs.ranks import Ranks

log = logging.getLogger(__name__)
KEEPALIVE_S = 1.0  # an idle rank 0 still broadcasts this often, far inside any collective timeout


class _Flags(IntFlag):
    STEP = 1
    STOP = 2
    AHEAD = 4
    LATE = 8


@dataclass(frozen=True)
class StepMessage:
    """One loop turn of rank 0: apply ``commands`` in order, then step if ``step`` at time ``now``
    (rank 0's clock, for lease expiry); ``stop`` ends the node. ``ahead``: rank 0 published the last
    command before applying it (``published_ahead``): whether it raised there is the next message's
    ``late``."""

    commands: tuple[EngineCommand | EngineCall, ...] = ()
    step: bool = False
    stop: bool = False
    now: float = 0.0
    failed: frozenset[int] = frozenset()  # the indexes of ``commands`` that raised on rank 0
    ahead: bool = False
    late: bool = False  # the previous message was ``ahead`` and its last command raised on rank 0


class StepBus(Protocol):
    """Rank 0's end. ``record`` each command as it is applied (then ``failed`` if applying it raised
    here: the other ranks must fail it too), ``publish`` once per loop turn, before its step, with
    the time the step uses; ``publish_ahead`` sends what was recorded at once, before rank 0 applies
    the last command (a ``failed`` after it goes out with the next message); ``stop`` ends the other
    ranks (commands recorded since the last turn are not sent: no step follows them). ``idle_wait``
    bounds an idle wait for commands (None: wait for ever); ``lost`` is called when a step or a
    broadcast failed, after which the ranks may no longer be in step."""

    idle_wait: float | None

    def record(self, command: EngineCommand | EngineCall) -> None: ...

    def failed(self) -> None: ...

    def publish(self, step: bool, now: float) -> None: ...

    def publish_ahead(self) -> None: ...

    def stop(self) -> None: ...

    def lost(self, error: BaseException) -> None: ...


class SoleBus:
    """A node of one rank: nobody to tell, and a failed step loses nothing (the loop goes on)."""

    idle_wait: float | None = None

    def record(self, command: EngineCommand | EngineCall) -> None:
        pass

    def failed(self) -> None:
        pass

    def publish(self, step: bool, now: float) -> None:
        pass

    def publish_ahead(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def lost(self, error: BaseException) -> None:
        pass


@dataclass
class LeaderBus:
    """Rank 0 of several. ``on_lost`` must not return: it takes the whole node down."""

    ranks: Ranks
    on_lost: Callable[[str], None]
    idle_wait: float | None = KEEPALIVE_S
    _pending: list[EngineCommand | EngineCall] = field(default_factory=list)
    _failed: set[int] = field(default_factory=set)
    _ahead: bool = False  # the last message went out ahead of its last command's outcome
    _late: bool = False  # ... and that command then raised here

    def record(self, command: EngineCommand | EngineCall) -> None:
        self._pending.append(for_other_ranks(command))  # raises for what cannot cross processes

    def failed(self) -> None:
        """The command recorded last raised here. One published ahead is marked in the next message;
        a collective one went out before it was applied too, and its ranks agree on its outcome
        themselves."""
        if self._pending:
            self._failed.add(len(self._pending) - 1)
        elif self._ahead:
            self._late = True

    def publish(self, step: bool, now: float) -> None:
        self._send(step, now, ahead=False)

    def publish_ahead(self) -> None:
        self._send(False, 0.0, ahead=True)

    def _send(self, step: bool, now: float, ahead: bool) -> None:
        commands, failed, self._pending, self._failed = tuple(self._pending), frozenset(self._failed), [], set()
        late, self._late, self._ahead = self._late, False, ahead
        _send(self.ranks, StepMessage(commands, step, now=now, failed=failed, ahead=ahead, late=late))

    def stop(self) -> None:
        _send(self.ranks, StepMessage(stop=True))

    def lost(self, error: BaseException) -> None:
        self.on_lost(f"rank 0 lost step with the other ranks: {error!r}")


@dataclass(frozen=True)
class FollowerBus:
    """Ranks 1..N-1: each ``receive`` waits (at most the group's timeout) for rank 0's next message."""

    ranks: Ranks

    def receive(self) -> StepMessage:
        header = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.ranks.control)
        flags, size, now = _Flags(int(header[0])), int(header[1]), _float(int(header[2]))
        commands: tuple[EngineCommand | EngineCall, ...] = ()
        failed: frozenset[int] = frozenset()
        if size:
            payload = torch.empty(size, dtype=torch.uint8)
            dist.broadcast(payload, src=0, group=self.ranks.control)
            commands, failed = pickle.loads(payload.numpy().tobytes())
        return StepMessage(commands, _Flags.STEP in flags, _Flags.STOP in flags, now, failed,
                           _Flags.AHEAD in flags, _Flags.LATE in flags)


def _send(ranks: Ranks, message: StepMessage) -> None:
    payload = pickle.dumps((message.commands, message.failed)) if message.commands else b""
    flags = _Flags(0)
    for flag, on in ((_Flags.STEP, message.step), (_Flags.STOP, message.stop), (_Flags.AHEAD, message.ahead),
                     (_Flags.LATE, message.late)):
        flags |= flag if on else 0
    header = [int(flags), len(payload), _bits(message.now)]  # the exact float: every rank compares the same time
    dist.broadcast(torch.tensor(header, dtype=torch.int64), src=0, group=ranks.control)
    if payload:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=ranks.control)


def _bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]
