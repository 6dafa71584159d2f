"""Requests of the reliability campaign and what came of each: one async HTTP call per request,
streaming or not, classified by status, error shape and output."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from enum import StrEnum

import httpx


class Result(StrEnum):
    OK = "ok"
    HTTP_ERROR = "http_error"  # a non-200 status with an OpenAI-shaped error body
    BAD_ERROR = "bad_error"  # a non-200 status whose body is not the OpenAI error shape
    STREAM_ERROR = "stream_error"  # 200, then an OpenAI-shaped error event ending the stream
    BROKEN = "broken"  # the connection broke, the stream ended without [DONE], or an unparseable body
    TIMEOUT = "timeout"  # no answer within the client's deadline: a hang
    DISCONNECTED = "disconnected"  # the client left on purpose


@dataclass(frozen=True)
class Request:
    """One completion request; ``max_tokens`` tokens with ``ignore_eos`` so outputs are comparable."""

    prompt: str
    max_tokens: int = 16
    stream: bool = False
    n: int = 1
    temperature: float = 0.0
    priority: int = 0  # vLLM's field: lower is more important
    deadline_ms: int | None = None  # its first token's deadline (``x-request-deadline-ms``)

    def body(self, model: str) -> dict:
        return {"model": model, "prompt": self.prompt, "max_tokens": self.max_tokens, "stream": self.stream,
                "n": self.n, "temperature": self.temperature, "ignore_eos": True, "priority": self.priority}

    def headers(self) -> dict[str, str]:
        return {} if self.deadline_ms is None else {"x-request-deadline-ms": str(self.deadline_ms)}


@dataclass
class Outcome:
    request: Request
    result: Result
    status: int = 0
    texts: list[str] = field(default_factory=list)  # per choice
    detail: str = ""
    seconds: float = 0.0
    first_s: float | None = None  # a stream's first text, from the send (its TTFT)
    code: str = ""  # an error's ``code`` (a 429's reason: ``deadline``, ``overloaded``, ...)


def is_error_shape(body: object) -> bool:
    """The OpenAI error body: ``{"error": {"message": str, "type": str, ...}}``."""
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


async def send(client: httpx.AsyncClient, model: str, request: Request, timeout_s: float = 120.0,
               leave_after_chunks: int | None = None) -> Outcome:
    """Sends ``request``; ``leave_after_chunks`` closes a stream after that many events (a client
    that disconnects mid-stream)."""
    started = time.monotonic()
    try:
        call = _stream(client, model, request, leave_after_chunks) if request.stream else _plain(client, model, request)
        outcome = await asyncio.wait_for(call, timeout_s)
        outcome.first_s = outcome.first_s - started if outcome.first_s is not None else None
    except TimeoutError:
        outcome = Outcome(request, Result.TIMEOUT, detail=f"no answer in {timeout_s:.0f} s")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        outcome = Outcome(request, Result.BROKEN, detail=f"{type(exc).__name__}: {exc}")
    outcome.seconds = time.monotonic() - started
    return outcome


async def _plain(client: httpx.AsyncClient, model: str, request: Request) -> Outcome:
    reply = await client.post("/v1/completions", json=request.body(model), headers=request.headers())
    if reply.status_code != 200:
        return _error(request, reply.status_code, reply.content)
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    return Outcome(request, Result.OK, 200, [c["text"] for c in choices])


def _error(request: Request, status: int, raw: bytes) -> Outcome:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    shaped = is_error_shape(body)
    result = Result.HTTP_ERROR if shaped else Result.BAD_ERROR
    code = str(body["error"].get("code") or "") if shaped else ""
    return Outcome(request, result, status, detail=raw[:200].decode(errors="replace"), code=code)


async def _stream(client: httpx.AsyncClient, model: str, request: Request, leave_after: int | None) -> Outcome:
    texts, first = [""] * request.n, None
    async with client.stream("POST", "/v1/completions", json=request.body(model), headers=request.headers()) as reply:
        if reply.status_code != 200:
            return _error(request, reply.status_code, await reply.aread())
        events = 0
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return Outcome(request, Result.OK, 200, texts, first_s=first)
            event = json.loads(data)
            if "error" in event:
                result = Result.STREAM_ERROR if is_error_shape(event) else Result.BROKEN
                return Outcome(request, result, 200, texts, detail=str(event["error"])[:200])
            for choice in event["choices"]:
                texts[choice["index"]] += choice.get("text") or ""
            first = first if first is not None or not event["choices"] else time.monotonic()
            events += 1
            if leave_after is not None and events >= leave_after:
                return Outcome(request, Result.DISCONNECTED, 200, texts)
    return Outcome(request, Result.BROKEN, 200, texts, detail="the stream ended without [DONE]")


async def send_all(base_url: str, model: str, requests: list[Request], concurrency: int,
                   timeout_s: float = 120.0) -> list[Outcome]:
    """Sends every request, ``concurrency`` at a time, in order; outcomes in request order."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        async def one(request: Request) -> Outcome:
            async with gate:
                return await send(client, model, request, timeout_s)

        return list(await asyncio.gather(*(one(r) for r in requests)))
