"""Bearer-key checks of the API routes and the admin routes."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Depends, Request

from tierserve.api import openai as oa


def api_key_check(api_key: str | None) -> Callable[[Request], Coroutine[Any, Any, None]]:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise oa.APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")

    return check


def admin_guard(admin_key: str | None) -> dict[str, Any]:
    """Route options for admin routes: off (403) without a key, else that key as a bearer token."""
    return {"dependencies": [Depends(_admin_auth(admin_key))]}


def _admin_auth(admin_key: str | None) -> Callable[[Request], Coroutine[Any, Any, None]]:
    check_key = api_key_check(admin_key)

    async def check(request: Request) -> None:
        if admin_key is None:
            raise oa.APIError(403, "the admin API is off: start the server with --admin-api-key")
        await check_key(request)

    return check
