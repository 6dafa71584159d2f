"""The single-engine OpenAI server as a real process on loopback, driven by the official client."""

from __future__ import annotations

import http.client
import json
import random
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from helpers import metrics
from helpers.polling import wait_for
from helpers.processes import ServeProcess

from tierserve.launch import free_port

pytestmark = pytest.mark.integration

API_KEY = "sekrit"
STARTUP_DEADLINE_S = 180


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path
    api_key: str | None = None

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0)

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


def test_serve_on_a_taken_port_says_so_before_loading_the_model(tiny_llama: Path) -> None:
    """It loaded the model, then uvicorn could not bind: the reason came last, after the load."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--model", str(tiny_llama), "--port", str(port)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stdout + out.stderr
    assert "engine ready" not in out.stdout + out.stderr, "the model was loaded first"


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, builtin_model: Path, tmp_path_factory) -> Iterator[dict[str, Server]]:
    """Both servers start together so their model loads overlap."""
    logs = tmp_path_factory.mktemp("server-logs")
    tiny = ServeProcess(["--model", str(tiny_llama), "--api-key", API_KEY, "--max-total-tokens", "2048"],
                        logs / "tiny.log")
    smol = ServeProcess(["--model", str(builtin_model), "--max-total-tokens", "4096", "--context-length", "2048"],
                        logs / "smol.log")
    started = {"tiny": (tiny, API_KEY), "smol": (smol, None)}
    try:
        yield {name: Server(node.wait_ready(STARTUP_DEADLINE_S).url, node.proc, node.log, key)
               for name, (node, key) in started.items()}
    finally:
        for node, _ in started.values():
            node.stop()


@pytest.fixture(scope="module")
def tiny(servers: dict[str, Server]) -> Server:
    """Tiny random Llama, no tokenizer (token-id prompts only), with an API key."""
    return servers["tiny"]


@pytest.fixture(scope="module")
def smol(servers: dict[str, Server]) -> Server:
    """The built-in SmolLM2 with its tokenizer and chat template, no API key."""
    return servers["smol"]


def _model(server: Server) -> str:
    return server.client().models.list().data[0].id


def _metric(server: Server, name: str, **labels: str) -> float:
    return metrics.value(metrics.scrape(server.url), name, **labels)


# ---- auth, routing, errors -------------------------------------------------------------------

def test_api_key_required(tiny: Server, tiny_llama: Path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{tiny.url}/v1/completions", json={"prompt": [1, 2]}, headers=headers, timeout=10)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{tiny.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{tiny.url}/metrics", timeout=10).status_code == 200
    bad = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert tiny.client().models.list().data[0].id == tiny_llama.name


def test_unknown_model_is_404(tiny: Server):
    with pytest.raises(openai.NotFoundError) as info:
        tiny.client().completions.create(model="no-such-model", prompt=[1, 2, 3], max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    with tiny.http() as http:
        assert http.get("/v1/nothing-here").json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": list(range(600))},  # longer than the model's 512 positions
        {"prompt": list(range(500)), "max_tokens": 100},  # fits alone, not with its max_tokens
        {"prompt": list(range(500)), "max_tokens": 100, "stream": True},  # 400 before the stream starts
        {"prompt": [1, 2], "max_tokens": -1},
        {"prompt": [1, 2], "max_tokens": "ten"},
        {"prompt": [1, 2], "temperature": "hot"},
        {"prompt": [1, 2], "top_p": 0},
        {"prompt": [1, 2], "stop": 5},
        {"prompt": [1, 2], "n": 0},
        {"prompt": [10**9]},  # not in the vocabulary
        {"prompt": [1, 2], "logprobs": 21},
        {"prompt": [1, 2], "min_tokens": 20},
        {"prompt": "text, but this model has no tokenizer"},
        {"max_tokens": 3},
    ],
)
def test_bad_request_is_400(tiny: Server, body: dict):
    with tiny.http() as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_malformed_json_is_400(tiny: Server):
    with tiny.http() as http:
        r = http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("body", [{"prompt": ""}, {"messages": []}, {"messages": [{"role": "user"}]}])
def test_bad_text_request_is_400(smol: Server, body: dict):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with smol.http() as http:
        assert http.post(path, json=body).status_code == 400


# ---- completions with token ids (tiny model) -------------------------------------------------

def test_completion_usage_and_streaming(tiny: Server):
    client, prompt = tiny.client(), [5, 6, 7, 8, 9]
    extra = {"ignore_eos": True, "metadata": {"run": "ignored on purpose"}}  # docs/agents.md: IGNORED_FIELDS
    full = client.completions.create(model=_model(tiny), prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body=extra)
    assert full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (5, 8, 13)
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    assert full.usage.model_extra["cached_tokens_by_tier"] == {"device": 0, "host": 0, "storage": 0}

    chunks = list(client.completions.create(model=_model(tiny), prompt=prompt, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=extra))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_n_choices_and_prompt_batches(tiny: Server):
    r = tiny.client().completions.create(model=_model(tiny), prompt=[[1, 2, 3], [4, 5]], n=2, max_tokens=3,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12


def test_n_choices_compute_the_prompt_once(tiny: Server):
    """``n`` greedy choices of one fresh prompt (docs/cache.md, in-flight sharing): one computes the
    prompt, the others its last partial page and last token only; all give the same text."""
    rng = random.Random(uuid.uuid4().int)  # a prompt no earlier test cached
    prompt = [rng.randrange(2, 384) for _ in range(100)]
    before = _metric(tiny, "tierserve_prefill_tokens_computed_total")
    r = tiny.client().completions.create(model=_model(tiny), prompt=[prompt], n=4, max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    computed = _metric(tiny, "tierserve_prefill_tokens_computed_total") - before
    assert len({c.text for c in r.choices}) == 1
    assert computed <= len(prompt) + 3 * 16, computed  # 16: serve's default page size


# ---- text and chat (built-in model) ----------------------------------------------------------

def test_chat_knows_paris_and_a_repeat_is_served_from_the_cache(smol: Server):
    """Asked twice under a tenant salt of its own (nothing cached before, whatever ran earlier):
    the first answer computes the whole prompt, the repeat finds every full page of it but the
    last token's in L1 (the server's page size is 16) and answers the same."""
    client, salt = smol.client(), f"paris-{uuid.uuid4()}"
    first, repeat = [client.chat.completions.create(
        model=_model(smol), messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0, extra_body={"cache_salt": salt}) for _ in range(2)]
    assert "Paris" in first.choices[0].message.content
    assert first.choices[0].message.role == "assistant"
    assert first.usage.prompt_tokens > 0 and 0 < first.usage.completion_tokens <= 20
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = (first.usage.prompt_tokens - 1) // 16 * 16
    assert cached > 0 and repeat.usage.prompt_tokens_details.cached_tokens == cached
    assert repeat.usage.model_extra["cached_tokens_by_tier"] == {"device": cached, "host": 0, "storage": 0}
    assert repeat.choices[0].message.content == first.choices[0].message.content


def test_greedy_stream_equals_non_stream(smol: Server):
    client, model = smol.client(), _model(smol)
    kwargs = dict(model=model, prompt="The three primary colors are", max_tokens=16, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert full and streamed == full

    messages = [{"role": "user", "content": [{"type": "text", "text": "Name a large animal."}]}]
    chat = dict(model=model, messages=messages, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**chat).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**chat, stream=True)
             if c.choices]
    assert full and "".join(parts) == full


def test_tokenize(smol: Server, builtin_model: Path):
    from tierserve.api.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(builtin_model)
    messages = [{"role": "user", "content": "hi"}]
    with smol.http() as http:
        assert http.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"] == tok.encode("hello world")
        chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert chat["count"] == len(chat["tokens"]) and chat["max_model_len"] == 2048


def _engine_idle(server: Server) -> bool:
    with server.http() as http:
        state = http.get("/debug/state").json()
    return state["running"] == 0 and state["waiting"] == 0 and state["kv_pages_used"] == 0


def test_client_disconnect_mid_stream_aborts(smol: Server):
    aborted = _metric(smol, "tierserve_requests_total", finish_reason="abort")
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=smol.url, timeout=60) as http, http.stream("POST", "/v1/completions",
                                                                          json=body) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
    # Leaving the block closed the connection long before 1500 tokens could be generated.
    wait_for(lambda: _metric(smol, "tierserve_requests_total", finish_reason="abort") == aborted + 1, "the abort", 30)
    wait_for(lambda: _engine_idle(smol), "the engine to release every page", 30)
    assert httpx.get(f"{smol.url}/health", timeout=10).status_code == 200
    assert smol.client().completions.create(model=_model(smol), prompt="Hi", max_tokens=2).choices[0].text


def test_client_disconnect_while_waiting_for_full_response_aborts(smol: Server):
    aborted = _metric(smol, "tierserve_requests_total", finish_reason="abort")
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{smol.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    wait_for(lambda: _metric(smol, "tierserve_requests_total", finish_reason="abort") == aborted + 1, "the abort", 30)
    wait_for(lambda: _engine_idle(smol), "the engine to release every page", 30)


def test_metrics_count_requests(smol: Server):
    before = _metric(smol, "tierserve_generation_tokens_total")
    smol.client().completions.create(model=_model(smol), prompt="Hello", max_tokens=3,
                                     extra_body={"ignore_eos": True})
    assert _metric(smol, "tierserve_generation_tokens_total") == before + 3
    assert _metric(smol, "tierserve_time_to_first_token_seconds_count") > 0
    assert _metric(smol, "tierserve_e2e_request_latency_seconds_count") > 0


def test_an_idle_connection_outlives_the_clients_pool_expiry(tiny: Server) -> None:
    """httpx and the openai SDK reuse a pooled connection idle for up to 5 s; a server that closes at
    5 s too races them and loses the request sent as it closes. Past those 5 s the connection still
    answers."""
    host, port = tiny.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() == b'{"status":"ok"}'
        time.sleep(httpx.Limits().keepalive_expiry + 1)  # the idle time under test, not a wait for readiness
        conn.sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # an open socket has nothing to read; a closed one reads b""
            conn.sock.recv(1)
    finally:
        conn.close()
