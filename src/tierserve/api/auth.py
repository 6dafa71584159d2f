"""Bearer-key checks of the API routes (a key names its tenant, ``api/tenants.py``) and of the
admin routes (a key of its own, never a tenant's)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Depends, Request

from tierserve.api import openai as oa
from tierserve.api.tenants import Tenant, TenantKeys


def bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _refused() -> oa.APIError:
    return oa.APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


def tenant_check(keys: TenantKeys | None) -> Callable[[Request], Coroutine[Any, Any, None]]:
    """Sets ``request.state.tenant`` from the bearer key (``None`` when the server has no keys:
    every client shares one namespace); an unknown or missing key is 401."""
    async def check(request: Request) -> None:
        request.state.tenant = None
        if keys is None:
            return
        tenant = keys.tenant(bearer(request) or "")
        if tenant is None:
            raise _refused()
        request.state.tenant = tenant

    return check


def request_tenant(request: Request) -> Tenant | None:
    return getattr(request.state, "tenant", None)


def api_key_check(api_key: str | None) -> Callable[[Request], Coroutine[Any, Any, None]]:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        token = bearer(request)
        if token is None or not secrets.compare_digest(token.encode(), api_key.encode()):
            raise _refused()

    return check


def admin_guard(admin_key: str | None, keys: TenantKeys | None = None) -> dict[str, Any]:
    """Route options for admin routes: off (403) without a key, else that key as a bearer token.
    A tenant's key never opens them: 403 (``check_admin_key`` also refuses an admin key that is one)."""
    return {"dependencies": [Depends(_admin_auth(admin_key, keys))]}


def debug_guard(admin_key: str | None, keys: TenantKeys | None) -> dict[str, Any]:
    """Route options for ``/debug/state``, which shows every tenant's routes and occupancy: an admin
    route as soon as the server has API keys or an admin key. A server with neither has no tenants
    to separate (every client is already anyone), so it stays open there, as tests and demos use it."""
    return {} if admin_key is None and keys is None else admin_guard(admin_key, keys)


def check_admin_key(admin_key: str | None, keys: TenantKeys | None) -> None:
    """``ValueError`` when the admin key is also a tenant's key: tenants must not reach admin routes."""
    if admin_key is not None and keys is not None and keys.holds(admin_key):
        raise ValueError("the admin API key must not be one of the tenants' API keys")


def _admin_auth(admin_key: str | None, keys: TenantKeys | None) -> Callable[[Request], Coroutine[Any, Any, None]]:
    check_key = api_key_check(admin_key)

    async def check(request: Request) -> None:
        if admin_key is None:
            raise oa.APIError(403, "the admin API is off: start the server with --admin-api-key")
        if keys is not None and keys.holds(bearer(request) or ""):
            raise oa.APIError(403, "a tenant's API key does not open admin routes", code="forbidden")
        await check_key(request)

    return check
