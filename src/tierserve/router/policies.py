"""How the router picks a worker among the available ones of a role (chosen per role by flag)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from tierserve.router.registry import Worker


class PolicyKind(Enum):
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    POWER_OF_TWO = "power_of_two"
    CACHE_AWARE = "cache_aware"


@dataclass(frozen=True)
class CachedPrefix:
    """Leading pages of a prompt a worker holds: ``device`` pages in L1, then ``host`` in L2."""

    device: int = 0
    host: int = 0


PrefixLookup = Callable[[Worker], CachedPrefix]  # for one prompt: what each worker caches of it


class Policy(Protocol):
    def pick(self, workers: Sequence[Worker], lookup: PrefixLookup) -> Worker:
        """One of ``workers`` (never empty)."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, workers: Sequence[Worker], lookup: PrefixLookup) -> Worker:
        return sorted(workers, key=lambda w: w.address)[next(self._counter) % len(workers)]


class Random:
    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, workers: Sequence[Worker], lookup: PrefixLookup) -> Worker:
        return self.rng.choice(list(workers))


class PowerOfTwo:
    """Two random workers, the less loaded one: near least-loaded without herding."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, workers: Sequence[Worker], lookup: PrefixLookup) -> Worker:
        pair = self.rng.sample(list(workers), min(2, len(workers)))
        return min(pair, key=lambda w: w.pressure)


@dataclass
class CacheAware:
    """Prefers the worker that would compute the fewest prompt pages: an L1 page saves more than
    an L2 page (which must still be copied to the device), and L3 is shared by all so it does not
    tell workers apart. Each request already running on a worker (``Worker.pressure``: as its node
    reports, every router's) costs ``load_cost`` pages. When
    the load is too uneven (max - min > ``balance_threshold``), it picks the least loaded instead,
    so a popular prefix cannot pile every request onto one node."""

    device_credit: float = 1.0
    host_credit: float = 0.6
    load_cost: float = 4.0
    balance_threshold: int = 8

    def __post_init__(self) -> None:
        self._fallback = RoundRobin()

    def pick(self, workers: Sequence[Worker], lookup: PrefixLookup) -> Worker:
        loads = [w.pressure for w in workers]
        if max(loads) - min(loads) > self.balance_threshold:
            return min(workers, key=lambda w: (w.pressure, w.address))
        cached = {w: lookup(w) for w in workers}
        if not any(c.device or c.host for c in cached.values()):  # nobody has it: spread by load
            least = min(loads)
            return self._fallback.pick([w for w in workers if w.pressure == least], lookup)
        return max(workers, key=lambda w: (self.score(cached[w], w.pressure), -w.pressure, w.address))

    def score(self, cached: CachedPrefix, load: int) -> float:
        return self.device_credit * cached.device + self.host_credit * cached.host - self.load_cost * load


def fitting(workers: Sequence[Worker], tokens: int) -> Sequence[Worker]:
    """The workers whose pool holds a request of ``tokens`` tokens of KV (``Worker.fits``: a CP
    node's ranks together hold ``cp_size`` times the pages of one); all of them when none does, so
    a node answers with its reason (a 400)."""
    fit = [w for w in workers if w.fits(tokens)]
    return fit or workers


def make_policy(kind: PolicyKind) -> Policy:
    return {PolicyKind.ROUND_ROBIN: RoundRobin, PolicyKind.RANDOM: Random, PolicyKind.POWER_OF_TWO: PowerOfTwo,
            PolicyKind.CACHE_AWARE: CacheAware}[kind]()
