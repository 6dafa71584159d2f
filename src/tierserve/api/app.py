"""The OpenAI-compatible HTTP API over any ``Backend``: one engine (``tierserve serve``) or the
router's prefill/decode pairs. Torch-free: the router imports it.

Each API request becomes one backend request per (prompt, choice) (``choices.py``). When the
client goes away mid-request the handler cancels those, which aborts the requests wherever they
run and frees their KV pages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierserve.api import openai as oa
from tierserve.api.admission import DEADLINE_HEADER, AdmissionPolicy, check_deadline, parse_deadline, shed_reason
from tierserve.api.auth import debug_guard, request_tenant, tenant_check
from tierserve.api.backend import Backend
from tierserve.api.choices import Choices, Job, make_jobs
from tierserve.api.formats import ChatFormat, CompletionFormat, Delta
from tierserve.api.logprobs import LogprobRenderer, LogprobShape
from tierserve.api.metrics import ApiMetrics
from tierserve.api.structured import json_schema
from tierserve.api.tenants import TenantKeys, TenantLimiter
from tierserve.api.tokenizer import ChatTemplateError, TextTokenizer
from tierserve.api.tool_parsers import ToolParserKind, reader_for
from tierserve.api.tools import ToolMode, ToolPlan
from tierserve.core.outputs import FinishReason
from tierserve.core.sampling import MAX_UINT32, InvalidRequestError, SamplingParams
from tierserve.core.scope import CacheScope
from tierserve.structured import grammars
from tierserve.tracing import NO_SPAN, NO_TRACER, Span, Tracer, using
from tierserve.tracing import attributes as at

log = logging.getLogger(__name__)
T = TypeVar("T")
Format = CompletionFormat | ChatFormat


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Runs ``work`` but cancels it (raising ``ClientDisconnected``) if the client hangs up first."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise ClientDisconnected()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Api:
    """The handlers; state is the backend, the tokenizer and the metrics, nothing global."""

    def __init__(self, backend: Backend, tokenizer: TextTokenizer | None, model_name: str,
                 metrics: ApiMetrics, admission: AdmissionPolicy, tracer: Tracer = NO_TRACER) -> None:
        self.backend, self.tokenizer, self.model_name = backend, tokenizer, model_name
        self.admission = admission
        self.max_model_len: int = backend.max_model_len
        self.metrics, self.tracer = metrics, tracer
        self.created = int(time.time())
        self.limiter = TenantLimiter()

    async def completions(self, request: Request) -> Response:
        body = oa.parse_body(oa.CompletionRequest, await request.body())
        self._check_model(body.model)
        texts = body.prompts()
        prompts = [self._prompt_ids(p) for p in texts]
        params = _deadlined(request, _checked(body.sampling_params(oa.DEFAULT_COMPLETION_MAX_TOKENS)))
        fmt = CompletionFormat(self.model_name, self._renderer(LogprobShape.COMPLETION, params.logprobs, body))
        echoes = [self._text_of(t) for t in texts] if body.echo else None
        jobs = make_jobs(fmt.id, prompts, params, body.num_choices, _scope(request, body.cache_salt), echoes)
        return await self._respond(request, jobs, fmt, body.stream, body.include_usage)

    async def chat(self, request: Request) -> Response:
        body = oa.parse_body(oa.ChatCompletionRequest, await request.body())
        self._check_model(body.model)
        plan = _checked_tools(body.tool_plan())
        text = self._render_chat(body.template_messages(), body.add_generation_prompt, plan.template_tools())
        ids = self._prompt_ids(self._need_tokenizer().encode(text, add_special_tokens=False))
        params = _deadlined(request, _checked(body.sampling_params(default_max_tokens=self.max_model_len - len(ids))))
        readers = None if plan.mode is ToolMode.NONE else partial(reader_for, plan, self._tool_parser())
        fmt = ChatFormat(self.model_name, self._renderer(LogprobShape.CHAT, params.logprobs, body), readers)
        jobs = make_jobs(fmt.id, [ids], params, body.num_choices, _scope(request, body.cache_salt))
        return await self._respond(request, jobs, fmt, body.stream, body.include_usage)

    async def _respond(self, request: Request, jobs: list[Job], fmt: Format, stream: bool | None,
                       include_usage: bool) -> Response:
        """Runs the jobs once their tenant is admitted (429 over its limits) and, under ``--admission
        ttft``, their predicted first token is within their deadline (429 at once otherwise); the
        tenant's slot is held until the response ends, a stream's included. Every 429 is counted
        by reason and priority. Traced, the response is a span whose children are the backend's
        (``docs/tracing.md``), ended with it."""
        try:
            self._check_deadlines(jobs)
            release = self._tenant_slot(request)
            span = self._span(request, fmt.id, jobs, bool(stream))
            with using(span):  # the backend's requests run in tasks made here: their spans are its children
                choices = Choices(self.backend, jobs, self.metrics, buffered=not stream)
            return await self._run(request, choices, _ending(span, release), span, fmt, len(jobs), stream,
                                   include_usage)
        except oa.APIError as exc:
            reason = shed_reason(exc)
            if reason is not None:
                self.metrics.shed.labels(reason.value, str(jobs[0].params.priority)).inc()
            raise

    def _tenant_slot(self, request: Request) -> Callable[[], None]:
        tenant = request_tenant(request)
        return self.limiter.admit(tenant) if tenant is not None else lambda: None

    def _check_deadlines(self, jobs: list[Job]) -> None:
        """429 when a prompt's predicted first token is past the deadline (``--admission ttft``)."""
        if self.admission is not AdmissionPolicy.TTFT or jobs[0].params.deadline_ms is None:
            return
        for job in jobs:
            if job.counts_prompt:
                predicted = self.backend.predict_ttft(job.prompt_ids, job.params, job.scope)
                check_deadline(predicted, job.params.deadline_ms)

    async def _run(self, request: Request, choices: Choices, release: Callable[[], None], span: Span, fmt: Format,
                   num_choices: int, stream: bool | None, include_usage: bool) -> Response:
        try:
            await _unless_disconnected(request, choices.start())
            if stream:
                return _SSEResponse(_sse_events(choices, fmt, num_choices, include_usage), choices, release)
            await _unless_disconnected(request, choices.run())
        except BaseException as exc:
            choices.cancel()
            span.fail(f"{type(exc).__name__}: {exc}")
            release()
            raise
        release()
        return _json(fmt.response(choices.results(), choices.usage()))

    def _span(self, request: Request, response_id: str, jobs: list[Job], stream: bool) -> Span:
        """The response's span: a child of the client's ``traceparent``, or a new trace's root."""
        if not self.tracer.enabled:
            return NO_SPAN
        return self.tracer.server(f"{request.method} {request.url.path}", request.headers, {
            "http.request.method": request.method, "url.path": request.url.path, at.REQUEST_ID: response_id,
            at.TENANT: jobs[0].scope.tenant, "tierserve.stream": stream, "tierserve.choices": len(jobs)})

    async def tokenize(self, request: Request) -> Response:
        body = oa.parse_body(oa.TokenizeRequest, await request.body())
        self._check_model(body.model)
        tokenizer = self._need_tokenizer()
        if body.messages is not None:  # rendered and encoded as chat does, its tools checked as chat checks them
            tools = _checked_tools(body.tool_plan()).template_tools()
            text = self._render_chat([m.template_dict() for m in body.messages], body.add_generation_prompt, tools)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return _json(oa.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_model_len))

    async def models(self) -> Response:
        card = oa.ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)
        return _json(oa.ModelList(data=[card]))

    async def health(self) -> Response:
        if self.backend.healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy"}, status_code=503)

    async def readiness(self) -> Response:
        if self.backend.ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503)

    async def debug_state(self) -> dict[str, Any]:
        return await self.backend.debug_state()

    def _renderer(self, shape: LogprobShape, top: int | None, body: oa.CompletionRequest | oa.ChatCompletionRequest,
                  ) -> LogprobRenderer | None:
        if top is None:
            return None
        return LogprobRenderer(shape, top, self.tokenizer, bool(body.return_tokens_as_token_ids))

    def _text_of(self, prompt: str | list[int]) -> str:
        """A prompt's text as echoed: as sent, or decoded from its token ids."""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt, skip_special_tokens=False) if self.tokenizer is not None else ""

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise oa.APIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                              param="model", code="model_not_found")

    def _need_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise oa.APIError(400, "this model has no tokenizer: send prompts as token ids to /v1/completions")
        return self.tokenizer

    def _tool_parser(self) -> ToolParserKind:
        tokenizer = self._need_tokenizer()
        if tokenizer.tool_call_parser is not None:
            return ToolParserKind(tokenizer.tool_call_parser)
        return ToolParserKind.for_template(tokenizer.chat_template)

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None = None) -> str:
        try:
            return self._need_tokenizer().apply_chat_template(messages, add_generation_prompt, tools)
        except ChatTemplateError as exc:
            raise oa.APIError(400, f"chat template: {exc}", param="messages") from None

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids pass as they are; text is tokenized (BOS only if the tokenizer config asks)."""
        ids = self._need_tokenizer().encode(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise oa.APIError(400, "the prompt is empty", param="prompt")
        if min(ids) < 0 or max(ids) > MAX_UINT32:
            raise oa.APIError(400, "prompt token ids must be in [0, 2^32) (and in the vocabulary)", param="prompt")
        if len(ids) >= self.max_model_len:
            raise oa.APIError(400, f"this model's maximum context length is {self.max_model_len} tokens, "
                                   f"but the prompt has {len(ids)} tokens", param="prompt")
        return ids


def _ending(span: Span, release: Callable[[], None]) -> Callable[[], None]:
    """``release`` that also ends ``span``."""

    def end() -> None:
        release()
        span.end()

    return end


def _checked(params: SamplingParams) -> SamplingParams:
    """``params`` once its structured output compiles within bounds (a 400 otherwise, before any
    engine sees it: docs/structured.md)."""
    if params.constraint is not None:
        grammars.check(params.constraint)
    return params


def _checked_tools(plan: ToolPlan) -> ToolPlan:
    """``plan`` once every tool's parameters compile as a JSON schema (a 400 names the tool)."""
    for tool in plan.tools:
        try:
            grammars.check(json_schema(tool.function.schema(), False))
        except InvalidRequestError as exc:
            raise oa.APIError(400, f"tool {tool.function.name!r}: {exc}", param="tools") from None
    return plan


def _deadlined(request: Request, params: SamplingParams) -> SamplingParams:
    """``params`` with the request's first-token deadline: its ``x-request-deadline-ms`` header, else
    its API key's default (400 for a header that is not a positive whole number)."""
    tenant = request_tenant(request)
    deadline = parse_deadline(request.headers.get(DEADLINE_HEADER), tenant.deadline_ms if tenant else None)
    return params if deadline is None else replace(params, deadline_ms=deadline)


def _scope(request: Request, cache_salt: str | None) -> CacheScope:
    """The request's cache namespace: the API key's tenant (none without keys), never the client's
    choice, subdivided by the client's ``cache_salt``."""
    tenant = request_tenant(request)
    return CacheScope("" if tenant is None else tenant.name, cache_salt or "")


async def _sse_events(choices: Choices, fmt: Format, num_choices: int,
                      include_usage: bool) -> AsyncIterator[bytes]:
    """The stream's events, then ``[DONE]``. A stream that cannot go on (the status line is long
    sent) ends with an OpenAI-shaped error event and, for every choice not finished, a last
    chunk with ``finish_reason: "error"`` (``docs/faults.md``)."""
    try:
        for chunk in fmt.opening_chunks(num_choices):
            yield oa.sse(chunk)
        async for delta in choices.events():
            chunk = fmt.chunk(delta) if delta.text or delta.finish_reason or delta.entries else None
            if chunk is not None:
                yield oa.sse(chunk)
        if include_usage:
            yield oa.sse(fmt.usage_chunk(choices.usage()))
    except Exception as exc:
        _log_stream_failure(exc)
        yield oa.sse(_stream_error(exc).body())
        for index in choices.unfinished():
            yield oa.sse(fmt.chunk(Delta(index, "", FinishReason.ERROR.value)))
    yield oa.SSE_DONE


def _log_stream_failure(exc: Exception) -> None:
    if isinstance(exc, oa.APIError | InvalidRequestError):  # expected: the backend logged its decision
        log.info("stream ended with an error: %s", exc)
    else:
        log.exception("stream failed")


def _stream_error(exc: Exception) -> oa.APIError:
    """The error event of a failed stream: the backend's own status and words when it gave them."""
    if isinstance(exc, oa.APIError):
        return exc
    return oa.APIError(400 if isinstance(exc, InvalidRequestError) else 500, str(exc))


class _SSEResponse(StreamingResponse):
    """An event stream that aborts its engine requests however it ends: finished, failed, or the
    client gone (even before the first event, when the body generator never started)."""

    def __init__(self, events: AsyncIterator[bytes], choices: Choices, release: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._choices, self._release = choices, release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._choices.cancel()
            self._release()


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def create_app(backend: Backend, tokenizer: TextTokenizer | None, model_name: str, metrics: ApiMetrics,
               keys: TenantKeys | None = None, admin_api_key: str | None = None,
               admission: AdmissionPolicy = AdmissionPolicy.TTFT, tracer: Tracer = NO_TRACER) -> FastAPI:
    """The HTTP app over a started backend. ``/health``, ``/readiness`` and ``/metrics`` are open;
    every other route needs ``Authorization: Bearer <key>`` with one of ``keys`` when set, the key
    naming the request's tenant (its cache namespace and its limits, ``api/tenants.py``), except
    ``/debug/state``, an admin route (``debug_guard``: the admin key, never a tenant's). Roles add
    their own routes (``guarded`` and ``admin_guard`` give the dependencies). Every error answer,
    an unexpected exception's 500 included, has the OpenAI shape and is counted in
    ``tierserve_http_errors_total`` by status. ``tracer``: each completion is a span (``docs/tracing.md``)."""
    api = _Api(backend, tokenizer, model_name, metrics, admission, tracer)
    app = FastAPI(title="tierserve", docs_url=None, redoc_url=None)
    guarded = {"dependencies": [Depends(tenant_check(keys))]}
    app.add_api_route("/v1/completions", api.completions, methods=["POST"], **guarded)
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"], **guarded)
    app.add_api_route("/v1/models", api.models, methods=["GET"], **guarded)
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"], **guarded)
    app.add_api_route("/debug/state", api.debug_state, methods=["GET"], **debug_guard(admin_api_key, keys))
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/readiness", api.readiness, methods=["GET"])
    app.add_api_route("/metrics", lambda: Response(generate_latest(metrics.registry),
                                                   media_type=CONTENT_TYPE_LATEST), methods=["GET"])

    def error(status: int, body: dict[str, Any]) -> Response:
        api.metrics.errors.labels(str(status), body["error"].get("code") or "").inc()
        return JSONResponse(body, status_code=status)

    @app.exception_handler(oa.APIError)
    async def on_api_error(_: Request, exc: oa.APIError) -> Response:
        response = error(exc.status, exc.body())
        response.headers.update(exc.headers)
        return response

    @app.exception_handler(InvalidRequestError)  # the engine's or SamplingParams' verdict on the input
    async def on_invalid(_: Request, exc: InvalidRequestError) -> Response:
        return error(400, oa.APIError(400, str(exc)).body())

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return error(exc.status_code, oa.APIError(exc.status_code, str(exc.detail)).body())

    @app.exception_handler(ClientDisconnected)
    async def on_gone(_: Request, __: ClientDisconnected) -> Response:
        api.metrics.errors.labels("499", "").inc()  # a request given up before its answer: worth seeing
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)  # a bug: Starlette logs the traceback after this answers
    async def on_unexpected(_: Request, exc: Exception) -> Response:
        return error(500, oa.APIError(500, f"internal server error ({type(exc).__name__}); see the server log",
                                      code="internal_error").body())

    return app


