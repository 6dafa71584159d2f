"""Runs an engine on its own thread and serves it to asyncio code."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from tierserve.core.sampling import SamplingParams
from tierserve.core.scope import NO_SCOPE, CacheScope
from tierserve.core.storage import StorageAction, StorageKind
from tierserve.engine.commands import (
    AbortRequest,
    AddRequest,
    CollectiveCall,
    EngineCall,
    EngineCommand,
    StartReserved,
    StorageControl,
    published_ahead,
    runs_collectives,
)
from tierserve.engine.engine import Engine
from tierserve.engine.handoff import Handoff, KVCheck
from tierserve.engine.procs.step_bus import SoleBus, StepBus
from tierserve.engine.request import RequestOutput
from tierserve.engine.step_watch import StepWatch

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.01  # a busy engine republishes its occupancy at most this often
RESERVED_WAIT_S = 0.05  # only reservations pending: a lease or a quarantine ends at most this late
# A step that scheduled nothing while background work is pending (an L3 read, an L2 write): the next
# turn waits this long, doubling each such turn up to IDLE_POLL_MAX_S (several ranks: each turn is a
# broadcast and a collective on every rank). What the wait is for wakes it (``set_waker``).
IDLE_POLL_S = 0.005
IDLE_POLL_MAX_S = 0.05
# While this rank waits only for another rank's probe or read to end (``awaits_peers``, at most
# ``PEER_WAIT_S`` in cache/storage_tier.py), the turns come this often: that rank's lane cannot wake
# this loop, and a CP=2 read from L3 lost half of IDLE_POLL_S on average to each such wait (issue 28).
PEER_POLL_S = 0.001


@dataclass
class _Submit:
    command: EngineCommand  # adds the request; may already produce output
    sink: Callable[[RequestOutput | BaseException], None]


class _Wake:
    """Ends the engine thread's wait (``EngineLoop.wake``); nothing to apply."""


_WAKE = _Wake()


@dataclass
class _Call:
    fn: Callable[[Engine], object]
    done: Callable[[object, BaseException | None], None]
    shared: EngineCall | None = None  # applied by every rank (``fn`` is its ``apply``)


class EngineLoop:
    """Owns an ``Engine`` and the only thread that touches it.

    Callers on any asyncio loop use ``generate``; commands reach the engine thread through a
    queue and results come back with ``call_soon_threadsafe``, so the model never runs inside the
    event loop. Cancelling the iterator (client gone) aborts the request and frees its pages.
    Other threads read the engine's occupancy through ``stats``, a snapshot the engine thread
    publishes, never the engine's own structures.

    On rank 0 of several, ``bus`` carries every command and step to the other ranks, which apply
    them in the same order (``follow`` in ``engine/procs/worker.py``). A ``call`` runs on rank 0
    only, so at several ranks it must not change the engine's requests or cache; ``apply`` runs
    an ``EngineCall`` on every rank and answers rank 0's result. A ``CollectiveCall`` is sent to
    the other ranks before rank 0 applies it, so all enter its collectives together.

    ``watch`` (several ranks): times every loop turn that talks to the other ranks; a turn past its
    bound makes ``healthy`` false until it ends (``engine/step_watch.py``).
    """

    def __init__(self, engine: Engine, bus: StepBus | None = None, watch: StepWatch | None = None) -> None:
        self.engine = engine
        self.bus = bus or SoleBus()
        self.watch = watch
        self._stats = engine.stats()  # the engine thread does not run yet
        self._backlog = engine.scheduler.backlog()
        self._published = 0.0
        self._idle_poll = IDLE_POLL_S
        self._commands: queue.SimpleQueue[_Submit | AbortRequest | _Call | _Wake | None] = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        engine.cache.set_waker(self.wake)  # an L3 probe a request waits on ends: step then, not at the next poll

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=30)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """The engine thread runs and its current turn (if watched) is within its bound; any thread."""
        return self.is_alive and not (self.watch is not None and self.watch.overdue())

    @property
    def num_requests(self) -> int:
        return len(self._sinks)

    def stats(self) -> dict[str, float]:
        """``Engine.stats()`` as of the engine's last step or command (at most ``STATS_INTERVAL_S``
        old while it works); any thread. The dict is replaced, never changed, so it is safe to read."""
        return self._stats

    def backlog(self) -> dict[int, int]:
        """``Scheduler.backlog()`` as of the same moment as ``stats``; any thread (replaced, never changed)."""
        return self._backlog

    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, scope: CacheScope = NO_SCOPE,
        handoff: Handoff | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields outputs until the finished one; raises the engine's error for a rejected request.
        ``scope`` and ``handoff`` are those of ``Engine.add_request``."""
        return self.stream(AddRequest(request_id, tuple(prompt_ids), params, scope, handoff))

    def generate_reserved(self, request_id: str, first_token: int, params: SamplingParams, resumed: int = 0,
                          check: KVCheck | None = None) -> AsyncIterator[RequestOutput]:
        """Like ``generate`` for a reservation whose prompt KV arrived (``Engine.start_reserved``)."""
        return self.stream(StartReserved(request_id, first_token, params, resumed, check))

    async def stream(self, command: EngineCommand) -> AsyncIterator[RequestOutput]:
        """Applies ``command`` on the engine thread, then yields its request's outputs until the
        finished one; aborts the request if the caller stops early."""
        loop = asyncio.get_running_loop()
        results: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def sink(item: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(results.put_nowait, item)

        self._commands.put(_Submit(command, sink))
        finished = False
        try:
            while not finished:
                item = await results.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(AbortRequest(command.request_id))

    def wake(self) -> None:
        """Any thread: the engine thread ends its wait and steps (background work it may use ended)."""
        self._commands.put(_WAKE)

    def abort(self, request_id: str) -> None:
        """Stops a request from any thread; its stream ends with an aborted output."""
        self._commands.put(AbortRequest(request_id))

    async def apply(self, command: EngineCall) -> object:
        """Like ``call`` for a change every rank of the node applies (``EngineCall``)."""
        return await self.call(command.apply, command)

    async def storage_admin(self, action: StorageAction, kind: StorageKind | None = None,
                            config: dict[str, Any] | None = None) -> dict[str, Any]:
        """``Engine.storage_admin``: a status read on rank 0, any other action on every rank."""
        if action is StorageAction.STATUS:
            return await self.call(lambda engine: engine.storage_admin(action))
        return await self.apply(StorageControl(action, kind, config or {}))

    async def call(self, fn: Callable[[Engine], object], shared: EngineCall | None = None) -> object:
        """Runs ``fn(engine)`` on the engine thread between steps; returns its result or raises."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def done(result: object, error: BaseException | None) -> None:
            def settle() -> None:
                if future.done():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

            loop.call_soon_threadsafe(settle)

        self._commands.put(_Call(fn, done, shared))
        return await future

    def _run(self) -> None:
        try:
            self._turns()
            self.bus.stop()
        except BaseException as exc:
            self.bus.lost(exc)  # several ranks: the node goes down; one rank: the thread ends as before
            raise
        for rid in list(self._sinks):
            self._deliver(self.engine.abort(rid), rid)
        self._publish(force=True)

    def _turns(self) -> None:
        """Loop turns until asked to stop: commands, then (told to every rank) whether a step runs."""
        while self._drain(self._wait()):
            step, now = self.engine.has_work(), time.monotonic()
            with self._watched(learn=step):
                self.bus.publish(step, now)
                if step:
                    self._step(now)
            self._publish()

    def _watched(self, learn: bool) -> AbstractContextManager[None]:
        """The watchdog's span around a turn that waits for the other ranks (nothing at one rank)."""
        return nullcontext() if self.watch is None else self.watch.span(learn, self._step_tokens)

    def _step_tokens(self) -> int:
        return self.engine.last_step_tokens

    def _publish(self, force: bool = False) -> None:
        """Engine thread: a fresh occupancy snapshot, always before waiting idle."""
        now = time.monotonic()
        if force or not self.engine.has_work() or now - self._published >= STATS_INTERVAL_S:
            self._stats, self._published = self.engine.stats(), now
            self._backlog = self.engine.scheduler.backlog()

    def _wait(self) -> float | None:
        """How long to wait for a command: when idle, forever (several ranks: until the bus must
        speak again); with only reservations waiting for their KV, until a lease may end (what
        starts them is a command, which wakes the wait: a decode node does not poll for its
        handoffs); when the last step could schedule nothing (e.g. every page pinned, a stuck L3
        read) a moment that doubles each such turn (``IDLE_POLL_S`` to ``IDLE_POLL_MAX_S``) so the
        thread neither spins nor steps a collective every few ms, but only ``PEER_POLL_S`` while this
        rank finished L3 work that another rank has not (``awaits_peers``: that rank's lane cannot
        wake this loop); else not at all."""
        if not self.engine.has_work() or self.engine.last_batch_size:
            self._idle_poll = IDLE_POLL_S
            return 0.0 if self.engine.has_work() else self.bus.idle_wait
        if self.engine.only_reservations():
            return min(RESERVED_WAIT_S, self.bus.idle_wait or RESERVED_WAIT_S)
        if self.engine.cache.awaits_peers:  # another rank is behind: no waker here tells when it is done
            return PEER_POLL_S
        return self._back_off()

    def _back_off(self) -> float:
        wait, self._idle_poll = self._idle_poll, min(2 * self._idle_poll, IDLE_POLL_MAX_S)
        return wait

    def _drain(self, wait: float | None) -> bool:
        """Applies queued commands, first waiting up to ``wait`` seconds (None: until one comes);
        False once asked to stop."""
        while True:
            try:
                command = self._commands.get(timeout=wait) if wait != 0 else self._commands.get_nowait()
            except queue.Empty:
                return True
            wait = 0
            if command is None:
                return False
            if isinstance(command, _Wake):
                continue
            if isinstance(command, _Call):
                self._call(command)
            elif isinstance(command, AbortRequest):
                self.bus.record(command)
                self._deliver(command.apply(self.engine), command.request_id)
            else:
                self._submit(command)

    def _submit(self, submit: _Submit) -> None:
        """Applies a new request's command; the other ranks apply it too, failing or not, as here."""
        request_id = submit.command.request_id
        try:
            self.bus.record(submit.command)
        except Exception as exc:
            submit.sink(exc)
            return
        try:
            if runs_collectives(submit.command):
                with self._watched(learn=False):
                    self.bus.publish(False, time.monotonic())  # the other ranks enter its collectives with this one
            elif published_ahead(submit.command):
                with self._watched(learn=False):
                    self.bus.publish_ahead()  # the other ranks apply it beside this one
            first = submit.command.apply(self.engine)
        except Exception as exc:
            self.bus.failed()  # the other ranks must fail it too
            submit.sink(exc)
            return
        self._sinks[request_id] = submit.sink
        self._deliver(first, request_id)

    def _call(self, command: _Call) -> None:
        """Runs the call, publishes the occupancy it changed, then answers: a caller that reads
        ``stats`` after its call returned sees the call's effect (e.g. a reservation's pages)."""
        try:
            if command.shared is not None:
                self.bus.record(command.shared)  # the other ranks apply it too, failing or not, as here
        except Exception as exc:
            command.done(None, exc)
            return
        if isinstance(command.shared, CollectiveCall):
            with self._watched(learn=False):
                self.bus.publish(False, time.monotonic())  # the other ranks enter its collectives with this one
        try:
            result = command.fn(self.engine)
        except Exception as exc:
            if command.shared is not None:
                self.bus.failed()  # the other ranks must fail it too
            command.done(None, exc)
            return
        self._publish(force=True)
        command.done(result, None)

    def _step(self, now: float) -> None:
        try:
            outputs = self.engine.step(now)
        except Exception as exc:
            log.exception("engine step failed")
            for rid in list(self._sinks):
                self.engine.abort(rid)
                self._sinks.pop(rid)(exc)
            self.bus.lost(exc)  # several ranks: one failed step leaves them out of step
            return
        for out in outputs:
            self._deliver(out, out.request_id)
        for rid, exc in self.engine.take_failures():
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink(exc)

    def _deliver(self, out: RequestOutput | None, request_id: str) -> None:
        sink = self._sinks.get(request_id)
        if sink is None or out is None:
            return
        if out.finished:
            self._sinks.pop(request_id, None)
        sink(out)
