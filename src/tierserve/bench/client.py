"""One streaming request to an OpenAI-compatible endpoint, measured.

``send`` never raises for a failed request: HTTP errors, error events inside the stream, a stream
that ends without ``data: [DONE]``, timeouts and connection failures all come back as a record
with ``ok`` false and the reason, so a benchmark counts them instead of dying or hiding them."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tierserve.bench.records import TIERS, Prompt, RequestRecord, RequestSpec

DEADLINE_HEADER = "x-request-deadline-ms"  # the server's (api/admission.py; the bench imports no server code)


@dataclass
class ClientConfig:
    """Where and how to send. ``base_url`` is the server root (``http://host:port``, a trailing
    ``/v1`` is accepted); ``extra_body`` is merged into every request (e.g. ``cache_salt``)."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 300.0
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def api_root(self) -> str:
        root = self.base_url.rstrip("/")
        return root if root.endswith("/v1") else root + "/v1"

    @property
    def server_root(self) -> str:
        """The root without ``/v1``: where ``/tokenize`` lives."""
        root = self.base_url.rstrip("/")
        return root.removesuffix("/v1")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(spec: RequestSpec, config: ClientConfig) -> tuple[str, dict[str, Any]]:
    """The path and JSON body for ``spec``: chat messages go to /chat/completions, token ids and
    text to /completions. Streaming with usage, so the last chunk reports prompt and cached tokens."""
    body: dict[str, Any] = {
        "max_tokens": spec.max_tokens, "temperature": config.temperature, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": config.ignore_eos, **config.extra_body,
    }
    if config.model:
        body["model"] = config.model
    if spec.priority is not None:
        body["priority"] = spec.priority
    if spec.is_chat:
        return "/chat/completions", {**body, "messages": spec.prompt}
    return "/completions", {**body, "prompt": spec.prompt}


async def discover_model(client: httpx.AsyncClient, config: ClientConfig) -> str | None:
    """The first model the server lists, or None when it lists none (or has no /v1/models)."""
    try:
        reply = await client.get(config.api_root + "/models", headers=config.headers(), timeout=10)
        data = reply.json().get("data") or []
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


class TokenizeError(Exception):
    """The server did not tokenize a prompt: no /tokenize route, no tokenizer, unreachable..."""


def tokenize_body(prompt: Prompt, config: ClientConfig) -> dict[str, Any]:
    """The /tokenize body that gives the ids /v1/completions (text: the tokenizer's special tokens
    as its config asks) or /v1/chat/completions (messages through the chat template) would use.
    ``add_generation_prompt`` follows ``extra_body``, since it reaches the chat request too."""
    body: dict[str, Any] = {"model": config.model} if config.model else {}
    if isinstance(prompt, str):
        return {**body, "prompt": prompt}
    generation = config.extra_body.get("add_generation_prompt", True)
    return {**body, "messages": prompt, "add_generation_prompt": generation}


async def tokenize(client: httpx.AsyncClient, config: ClientConfig, prompt: Prompt) -> list[int]:
    """The token ids the server makes of a text or chat ``prompt`` (its ``POST /tokenize``).
    Raises ``TokenizeError`` with the reason when there are none."""
    try:
        reply = await client.post(config.server_root + "/tokenize", json=tokenize_body(prompt, config),
                                  headers=config.headers(), timeout=config.timeout_s)
    except httpx.HTTPError as exc:
        raise TokenizeError(f"{type(exc).__name__}: {exc}") from None
    if reply.status_code != 200:
        raise TokenizeError(f"HTTP {reply.status_code}: {_error_message(reply.text)}")
    try:
        return [int(t) for t in reply.json()["tokens"]]
    except (ValueError, KeyError, TypeError):
        raise TokenizeError(f"not a /tokenize answer: {reply.text[:200]}") from None


async def send(client: httpx.AsyncClient, config: ClientConfig, spec: RequestSpec, record: RequestRecord,
               t0: float) -> RequestRecord:
    """Sends ``spec`` and fills ``record`` (returned). ``t0`` is the run's ``perf_counter`` origin."""
    path, body = request_body(spec, config)
    headers = config.headers() | ({DEADLINE_HEADER: str(spec.deadline_ms)} if spec.deadline_ms is not None else {})
    if isinstance(spec.prompt, list) and spec.prompt and isinstance(spec.prompt[0], int):
        record.sent_prompt_tokens = len(spec.prompt)
    start = time.perf_counter()
    record.sent_at = start - t0
    try:
        async with asyncio.timeout(config.timeout_s):
            await _stream(client, config.api_root + path, body, headers, record, start)
    except TimeoutError:
        record.ok, record.error = False, f"timeout after {config.timeout_s} s"
    except httpx.HTTPError as exc:
        record.ok, record.error = False, f"{type(exc).__name__}: {exc}"
    return record


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                  record: RequestRecord, start: float) -> None:
    async with client.stream("POST", url, json=body, headers=headers, timeout=None) as reply:
        record.status = reply.status_code
        if reply.status_code != 200:
            text = (await reply.aread()).decode(errors="replace")
            record.error = f"HTTP {reply.status_code}: {_error_message(text)}"
            return
        done = await _read_events(reply, record, start)
    if record.error is None and not done:
        record.error = "the stream ended without data: [DONE]"
    elif record.error is None and record.ttft is None:
        record.error = "the stream carried no output"
    record.ok = record.error is None


async def _read_events(reply: httpx.Response, record: RequestRecord, start: float) -> bool:
    """Reads SSE events until ``[DONE]`` (True) or the end of the stream (False)."""
    last: float | None = None
    parts: list[str] = []
    async for line in reply.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, "event:" lines
        data, now = line[5:].strip(), time.perf_counter()
        record.e2e = now - start
        if data == "[DONE]":
            record.text = "".join(parts)
            return True
        try:
            event = json.loads(data)
        except ValueError:
            record.error = f"malformed event: {data[:200]}"
            continue
        if not isinstance(event, dict) or "error" in event:
            record.error = f"stream error: {_error_message(data)}"
            continue
        if _has_output(event, parts):
            if last is None:
                record.ttft = now - start
            else:
                record.itl.append(now - last)
            last = now
        if event.get("usage"):
            _read_usage(event["usage"], record)
    record.text = "".join(parts)
    return False


def _has_output(event: dict[str, Any], parts: list[str]) -> bool:
    """Whether a chunk carries output (text, or the finish reason of a choice); collects the text."""
    found = False
    for choice in event.get("choices") or []:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            parts.append(text)
            found = True
        found = found or choice.get("finish_reason") is not None
    return found


def _read_usage(usage: dict[str, Any], record: RequestRecord) -> None:
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = int(details.get("cached_tokens") or 0)
    tiers = usage.get("cached_tokens_by_tier") or {}
    record.cached_by_tier = {t: int(tiers.get(t) or 0) for t in TIERS}
    spec = usage.get("speculative") or {}
    record.draft_tokens = int(spec.get("draft_tokens") or 0)
    record.accepted_tokens = int(spec.get("accepted_tokens") or 0)


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:300]
