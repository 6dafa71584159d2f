"""Bad input: each case must get a 4xx in the OpenAI error shape, never a 5xx or a hang, and
leave nothing allocated (issue 13's list, plus malformed JSON, wrong types, deep nesting,
1 MB prompts and 1,000 stop strings)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
from faults.load import is_error_shape

BIG = 2**64


@dataclass(frozen=True)
class Case:
    name: str
    raw: bytes  # the request body as sent (some cases are not valid JSON on purpose)
    path: str = "/v1/completions"
    method: str = "POST"
    admin: bool = False
    may_succeed: bool = False  # valid, only unusual: served (200) or refused (4xx), never a 5xx or a hang


def _completion(name: str, **fields: object) -> bytes:
    return json.dumps({"model": name, "prompt": "hello", "max_tokens": 4} | fields).encode()


def _with_raw(model: str, key: str, raw: str) -> bytes:
    """A completion body with ``key`` set to ``raw`` verbatim (not valid JSON, or too deep for it)."""
    return _completion(model).replace(b'"max_tokens"', f'"{key}": {raw}, "max_tokens"'.encode())


def cases(model: str, vocab: int) -> list[Case]:
    def c(name: str, **fields: object) -> Case:
        return Case(name, _completion(model, **fields))

    nested = "[" * 100_000 + "]" * 100_000
    return [
        c("seed -1", seed=-1), c("seed 2^64", seed=BIG), c("max_tokens 2^32", max_tokens=2**32),
        c("max_tokens -1", max_tokens=-1), c("top_k 2^31", top_k=2**31), c("top_p 2", top_p=2),
        c("stop_token_ids 2^40", stop_token_ids=[2**40]), c("n 0", n=0), c("n 2^40", n=2**40),
        c("prompt id -1", prompt=[5, -1]), c("prompt id 2^32", prompt=[2**32]),
        c("prompt id = vocab", prompt=[vocab]), c("nested prompt id -1", prompt=[[5], [-1]]),
        c("nested prompt id 2^32", prompt=[[2**32]]), c("empty prompt", prompt=""), c("empty id list", prompt=[]),
        *[Case(f"temperature {v}", _with_raw(model, "temperature", v)) for v in ("Infinity", "-Infinity", "NaN")],
        c("temperature 1e39", temperature=1e39), c("temperature -1", temperature=-1),
        Case("malformed JSON", b'{"model": "x", "prompt": '), Case("not an object", b"[1, 2, 3]"),
        Case("binary body", bytes(range(256))), c("prompt of wrong type", prompt={"a": 1}),
        c("max_tokens string", max_tokens="many"), c("stop of wrong type", stop=[1, 2]),
        c("unknown model", model="no-such-model"), Case("deep nesting", _with_raw(model, "prompt", nested)),
        c("1 MB prompt", prompt="hello " * 175_000),
        Case("1,000 stop strings", _completion(model, stop=[f"s{i}" for i in range(1000)]), may_succeed=True),
        Case("chat without messages", json.dumps({"model": model}).encode(), "/v1/chat/completions"),
        Case("chat message of wrong type", json.dumps({"model": model, "messages": [1]}).encode(),
             "/v1/chat/completions"),
        *[Case(f"worker address {a}", json.dumps({"role": "decode", "address": a}).encode(), "/workers", admin=True)
          for a in ("[::1:5", "a:b:c:1", "localhost:99999", "nohost", ":80")],
    ]


@dataclass
class Verdict:
    case: Case
    status: int
    shaped: bool  # the body is the OpenAI error shape

    @property
    def passed(self) -> bool:
        return (400 <= self.status < 500 and self.shaped) or (self.status == 200 and self.case.may_succeed)


async def check(client: httpx.AsyncClient, case: Case, admin_key: str) -> Verdict:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {admin_key}"} if case.admin else {})
    try:
        reply = await client.request(case.method, case.path, content=case.raw, headers=headers, timeout=60)
    except httpx.TimeoutException:
        return Verdict(case, -1, False)  # a hang
    except httpx.HTTPError:
        return Verdict(case, 0, False)  # the connection broke
    try:
        shaped = is_error_shape(reply.json())
    except ValueError:
        shaped = False
    return Verdict(case, reply.status_code, shaped)
