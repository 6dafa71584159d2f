"""The router over real prefill and decode processes on the built-in model: the OpenAI API
(completions, chat, streaming, errors), outputs equal to the single engine, client disconnects,
admission control and the admin worker API."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers.pd_nodes import load
from helpers.polling import wait_for
from helpers.processes import MasterProcess, NodeProcess, RouterProcess, free_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ARGS = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096"]
ADMIN = {"Authorization": "Bearer admin-secret"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def cluster(builtin_model: Path, tmp_path_factory) -> Iterator[tuple[RouterProcess, NodeProcess, NodeProcess]]:
    """mooncake_master, 2 prefill nodes and 1 decode node sharing L3, and the router."""
    logs = tmp_path_factory.mktemp("router")
    master = MasterProcess(logs / "master.log").start()
    l3_config = {"master_server_address": master.address, "global_segment_size": 128 << 20}
    l3 = ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
          "--hicache-storage-backend-extra-config", json.dumps(l3_config)]
    args = ["--model", str(builtin_model), *ARGS, *l3, "--kv-events-port", "0"]  # as `tierserve up` runs them
    prefills = [NodeProcess("prefill", args, logs / f"prefill{i}.log") for i in range(2)]
    decode = NodeProcess("decode", args, logs / "decode.log")
    router = None
    try:
        for proc in (*prefills, decode):
            proc.wait_ready()
        workers = [a for p in prefills for a in ("--prefill", p.address)]
        router = RouterProcess(["--model", str(builtin_model), *workers, "--decode", decode.address,
                                "--admin-api-key", "admin-secret", "--health-check-interval", "0.5"],
                               logs / "router.log").wait_ready()
        yield router, prefills[0], decode
    finally:
        for proc in (router, *prefills, decode):
            if proc is not None:
                proc.stop()
        master.kill()


@pytest.fixture()
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster[0].url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def single(builtin_model: Path) -> Engine:
    """The single engine every answer through the router must equal (one load of the model)."""
    return Engine(EngineConfig(builtin_model, device="cpu", dtype="float32", max_total_tokens=4096))


def _generate(engine: Engine, ids: list[list[int]], params: SamplingParams) -> list[str]:
    """``engine``'s answers to ``ids`` from an empty cache (as a fresh engine's: no hit of an earlier call)."""
    engine.cache.flush(True, True)
    return [engine.tokenizer.decode(o, skip_special_tokens=True) for o in engine.generate(ids, params)]


@pytest.fixture(scope="module")
def expected(single: Engine) -> list[str]:
    ids = [single.tokenizer.encode(p).ids for p in PROMPTS]
    return _generate(single, ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))


def complete(router: RouterProcess, prompt, **fields) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True} | fields
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)


def test_openai_client_gets_the_single_engine_text(client: openai.OpenAI, expected: list[str]) -> None:
    extra = {"ignore_eos": True}
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS, max_tokens=12, temperature=0,
                                    extra_body=extra)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected
    assert out.usage.completion_tokens == 12 * len(PROMPTS)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12,
                                           temperature=0, stream=True, extra_body=extra)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want


def test_openai_chat_streaming_and_second_turn_hits_the_cache(client: openai.OpenAI, builtin_model: Path,
                                                              single: Engine) -> None:
    question = "Tell me about the history of the city of Paris in detail. " * 8
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": question}]
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                           temperature=0)
    answer = first.choices[0].message.content
    assert answer == _single_engine_chat(builtin_model, single, messages, 16)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And its population?"}]
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _single_engine_chat(builtin_model, single, messages, 16)
    second = chunks[-1].usage
    assert second.prompt_tokens_details.cached_tokens > (first.usage.prompt_tokens_details.cached_tokens or 0)


def _single_engine_chat(model: Path, engine: Engine, messages: list[dict], max_tokens: int) -> str:
    from tierserve.api.tokenizer import try_load

    tokenizer = try_load(model)
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, True), add_special_tokens=False)
    return _generate(engine, [ids], SamplingParams(max_tokens=max_tokens, temperature=0))[0]


def test_streaming_with_usage_reports_cached_tokens_by_tier(cluster, expected: list[str]) -> None:
    router, _, _ = cluster
    long_prompt = PROMPTS[0] + " Paris. " * 60  # several pages, so a repeat hits the prefill's cache
    complete(router, long_prompt)
    body = {"prompt": long_prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    details = usage["prompt_tokens_details"]
    assert details["cached_tokens"] > 0
    assert sum(usage["cached_tokens_by_tier"].values()) == details["cached_tokens"]
    assert usage["cached_tokens_by_tier"]["device"] == details["cached_tokens"]


def test_chat_completion_answers_paris(cluster) -> None:
    router, _, _ = cluster
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
            "temperature": 0}
    r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_errors_have_the_openai_shape_and_status(cluster) -> None:
    router, _, _ = cluster
    cases = [
        (complete(router, ""), 400),
        (complete(router, "hi", max_tokens=-1), 400),
        (complete(router, "hi", max_tokens="ten"), 400),
        (complete(router, [5] * 9000), 400),
        (complete(router, "hi", model="no-such-model"), 404),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["message"] and error["type"]
    models = httpx.get(f"{router.url}/v1/models").json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"


OUT_OF_RANGE = [  # each crashed the router with a 500 (protobuf "Value out of range") or was accepted
    {"seed": -1}, {"seed": 2**64}, {"max_tokens": 2**32}, {"top_k": 2**31}, {"stop_token_ids": [2**40]},
    {"prompt": [-1, 5]}, {"prompt": [2**32, 5]}, {"prompt": [[5, 6], [2**32]]},
    {"temperature": 1e39}, {"temperature": float("inf")}, {"temperature": -float("inf")},
]


@pytest.mark.parametrize("fields", OUT_OF_RANGE, ids=str)
def test_out_of_range_values_get_400_not_500(cluster, fields: dict) -> None:
    router, _, _ = cluster
    body = {"prompt": "hi", "max_tokens": 2, **fields}
    r = httpx.post(f"{router.url}/v1/completions", content=json.dumps(body), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("address", ["[::1:5", "a:b:c:1", "127.0.0.1:99999", "host:0", ":80", "[]:80"])
def test_malformed_worker_addresses_are_refused(cluster, address: str) -> None:
    router, _, _ = cluster
    r = httpx.post(f"{router.url}/workers", json={"role": "decode", "address": address}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "address", r.text


def test_client_disconnect_aborts_on_both_nodes(cluster) -> None:
    router, prefill, decode = cluster
    body = {"prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break  # leave mid-stream: the connection closes

    async def idle() -> bool:
        d, p = await load(decode.address), await load(prefill.address)
        return d.running == 0 and d.kv_pages_used == 0 and p.running == 0 and p.kv_pages_used == 0

    wait_for(idle, "both nodes drop the request and its pages", 20)


def test_admin_workers_api_and_no_healthy_decode(cluster) -> None:
    router, _, decode = cluster
    assert httpx.get(f"{router.url}/workers").status_code == 401
    assert httpx.get(f"{router.url}/workers", headers={"Authorization": "Bearer wrong"}).status_code == 401
    workers = httpx.get(f"{router.url}/workers", headers=ADMIN).json()["workers"]
    assert {(w["role"], w["state"]) for w in workers} == {("prefill", "healthy"), ("decode", "healthy")}
    gone = {"role": "decode", "address": decode.address}
    assert httpx.request("DELETE", f"{router.url}/workers", json=gone, headers=ADMIN).status_code == 200
    try:
        r = complete(router, "hi")
        assert r.status_code == 503 and "no healthy decode worker" in r.json()["error"]["message"]
        assert httpx.get(f"{router.url}/readiness").status_code == 503
        dead = {"role": "decode", "address": f"127.0.0.1:{free_port()}"}
        assert httpx.post(f"{router.url}/workers", json=dead, headers=ADMIN).json()["state"] == "unhealthy"
        assert httpx.post(f"{router.url}/workers", json={"role": "x"}, headers=ADMIN).status_code == 400
    finally:
        assert httpx.post(f"{router.url}/workers", json=gone, headers=ADMIN).json()["state"] == "healthy"
    assert complete(router, "hi").status_code == 200


def test_a_worker_of_another_namespace_is_refused_and_identified_again_at_its_address(builtin_model: Path, cluster,
                                                                                     tmp_path: Path) -> None:
    """A worker of another namespace (another page size) is refused and the others serve. Another
    process at the same address (a restart with other weights or settings) is checked again:
    accepted once the right one is there, refused again when its namespace differs. (One test:
    each decode node of the built-in model takes seconds to start.)"""
    router, _, _ = cluster
    port = free_port()
    body = {"role": "decode", "address": f"127.0.0.1:{port}"}
    node = NodeProcess("decode", ["--model", str(builtin_model), *ARGS, "--page-size", "32"], tmp_path / "other.log",
                       port=port).wait_ready()
    try:
        r = httpx.post(f"{router.url}/workers", json=body, headers=ADMIN)
        assert r.json()["state"] == "refused" and "namespace" in r.json()["reason"]
        assert complete(router, "hi").status_code == 200  # served by the others
        for extra, state in (([], "healthy"), (["--page-size", "32"], "refused")):
            node.stop()
            node = NodeProcess("decode", ["--model", str(builtin_model), *ARGS, *extra], tmp_path / f"{state}.log",
                               port=port).wait_ready()
            wait_for(lambda s=state: _worker_state(router, body["address"]) == s, f"the new process is {state}", 30)
    finally:
        httpx.request("DELETE", f"{router.url}/workers", json=body, headers=ADMIN)
        node.stop()


def _worker_state(router: RouterProcess, address: str) -> str | None:
    workers = httpx.get(f"{router.url}/workers", headers=ADMIN).json()["workers"]
    return next((w["state"] for w in workers if w["role"] == "decode" and w["address"] == address), None)


def test_full_admission_queue_answers_429(builtin_model: Path, cluster, tmp_path: Path) -> None:
    _, prefill, decode = cluster
    small = RouterProcess(["--model", str(builtin_model), "--prefill", prefill.address, "--decode", decode.address,
                           "--max-running-requests", "1", "--max-queued-requests", "0"],
                          tmp_path / "small.log").wait_ready()
    try:
        codes: list[int] = []
        slow = threading.Thread(target=lambda: codes.append(complete(small, PROMPTS[0], max_tokens=60).status_code))
        slow.start()
        wait_for(lambda: _running(decode.address), "the first request runs", 30)
        r = complete(small, PROMPTS[1])
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        slow.join(60)
        assert codes == [200]
    finally:
        small.stop()


async def _running(address: str) -> bool:
    return (await load(address)).running > 0


_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.text(max_size=5),
                  st.lists(st.integers(-2, 5), max_size=3))
_PROMPTS = st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 60000), max_size=6),
                     st.lists(st.text(max_size=8), max_size=2), _JUNK)
_FIELDS = {
    "prompt": _PROMPTS,
    "max_tokens": st.one_of(st.integers(-3, 6), st.just(10**9), _JUNK),
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), _JUNK),
    "top_p": st.one_of(st.floats(-0.5, 1.5, allow_nan=False), _JUNK),
    "top_k": st.one_of(st.integers(-3, 50), _JUNK),
    "n": st.one_of(st.integers(-1, 3), _JUNK),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2), _JUNK),
    "seed": st.one_of(st.integers(-5, 2**40), _JUNK),
    "stream": _JUNK,
    "model": st.one_of(st.just("SmolLM2-135M-Instruct"), _JUNK),
    "surprise": _JUNK,
}
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot", ""]),
                                   "content": st.one_of(st.text(max_size=20), _JUNK)})
_MESSAGES = st.one_of(_JUNK, st.lists(_MESSAGE, max_size=3))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.fixed_dictionaries({}, optional=_FIELDS), chat=st.booleans(), messages=_MESSAGES)
def test_fuzzed_bodies_never_get_a_5xx(cluster, body: dict, chat: bool, messages) -> None:
    router = cluster[0]
    if chat:
        body = {k: v for k, v in body.items() if k != "prompt"} | {"messages": messages}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if isinstance(body.get("max_tokens"), int) and 6 < body["max_tokens"] < 10**9:
        body["max_tokens"] = 6
    body.setdefault("max_tokens", 4)  # chat's default is the whole context: too slow on a CPU
    r = httpx.post(f"{router.url}{path}", json=body, timeout=120)
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["message"], r.text


def test_nothing_is_left_allocated_after_the_fuzz(cluster) -> None:
    _, prefill, decode = cluster

    async def idle() -> bool:
        d, p = await load(decode.address), await load(prefill.address)
        return d.running == d.waiting == d.reservations == 0 and d.kv_pages_used == 0 and p.kv_pages_used == 0

    wait_for(idle, "the nodes hold no request pages", 30)
