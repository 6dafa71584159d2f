"""Tenants from API keys (``--api-keys FILE``, ``docs/tenancy.md``): each key names
its tenant and that tenant's limits. The tenant, never the client, decides a request's cache
namespace (``core/scope.py``, ``CacheScope``); a client's ``cache_salt`` only subdivides it.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tierserve.api import openai as oa

SINGLE_TENANT = "default"  # the tenant of the one key of ``--api-key``
WINDOW_S = 60.0  # requests_per_minute counts the requests of the last minute


@dataclass(frozen=True)
class Tenant:
    """A tenant and its limits (``None``: unlimited); ``deadline_ms``: the first-token deadline of its
    requests that send no ``x-request-deadline-ms`` (None: none, ``api/admission.py``)."""

    name: str
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    deadline_ms: int | None = None


class TenantKeys:
    """Bearer keys to tenants. Keys are held as SHA-256 digests, so that looking one up takes the
    same time whatever prefix of a real key the client guessed."""

    def __init__(self, keys: dict[str, Tenant]) -> None:
        if not keys:
            raise ValueError("an API key file needs at least one key")
        self._by_digest = {_digest(k): t for k, t in keys.items()}

    @classmethod
    def single(cls, key: str) -> TenantKeys:
        """``--api-key``: one key, one tenant, no limits."""
        return cls({key: Tenant(SINGLE_TENANT)})

    @classmethod
    def load(cls, path: Path) -> TenantKeys:
        """``{"keys": {"<key>": {"tenant": "<name>", "max_concurrent": n, "requests_per_minute": n,
        "deadline_ms": n}}}``;
        ``ValueError`` saying what is wrong with the file."""
        try:
            raw = json.loads(path.read_text())
            return cls({str(k): _tenant(v) for k, v in raw["keys"].items()})
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not an API key file ({type(exc).__name__}: {exc})") from None

    def tenant(self, key: str) -> Tenant | None:
        return self._by_digest.get(_digest(key))

    def holds(self, key: str) -> bool:
        return self.tenant(key) is not None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _tenant(entry: dict) -> Tenant:
    name = entry["tenant"]
    limits = [entry.get(k) for k in ("max_concurrent", "requests_per_minute", "deadline_ms")]
    if not isinstance(name, str) or not name or any(v is not None and (type(v) is not int or v < 1) for v in limits):
        raise TypeError(f"bad entry {entry!r}: tenant must be a name, limits integers >= 1")
    return Tenant(name, *limits)


@dataclass
class _Usage:
    running: int = 0
    started: deque[float] = field(default_factory=deque)  # start times within the last minute


class TenantLimiter:
    """Admission by tenant: at most ``max_concurrent`` API requests at once and
    ``requests_per_minute`` in any sliding minute; beyond that 429 with ``Retry-After``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._usage: dict[str, _Usage] = {}
        self._clock = clock

    def admit(self, tenant: Tenant) -> Callable[[], None]:
        """Counts one request of ``tenant`` in; returns its release (idempotent) or raises 429."""
        usage, now = self._usage.setdefault(tenant.name, _Usage()), self._clock()
        while usage.started and usage.started[0] <= now - WINDOW_S:
            usage.started.popleft()
        if tenant.max_concurrent is not None and usage.running >= tenant.max_concurrent:
            raise _too_many(f"tenant {tenant.name!r} has {usage.running} requests running (its limit)", 1)
        if tenant.requests_per_minute is not None and len(usage.started) >= tenant.requests_per_minute:
            wait = usage.started[0] + WINDOW_S - now
            raise _too_many(f"tenant {tenant.name!r} sent {len(usage.started)} requests this minute (its limit)",
                            wait)
        usage.running += 1
        usage.started.append(now)
        return _once(lambda: setattr(usage, "running", usage.running - 1))


def _too_many(message: str, retry_after_s: float) -> oa.APIError:
    return oa.APIError(429, f"{message}; retry later", code="tenant_limit",
                       headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def _once(release: Callable[[], None]) -> Callable[[], None]:
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            release()

    return call
