"""Tenants from API keys (``--api-keys``): the key, never the client's ``cache_salt``, decides the
cache namespace; unknown keys 401, limits 429 with ``Retry-After``, admin routes refuse tenant keys.
Unit tests of the key file and the limiter, then a real ``tierserve serve``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers.polling import wait_until
from helpers.processes import NodeProcess, RouterProcess, ServeProcess, free_port, running_up

from tierserve.api import openai as oa
from tierserve.api.tenants import Tenant, TenantKeys, TenantLimiter
from tierserve.core.scope import CacheScope

KEYS = {"keys": {"key-a": {"tenant": "acme"}, "key-b": {"tenant": "globex"},
                 "key-one": {"tenant": "solo", "max_concurrent": 1},
                 "key-rpm": {"tenant": "metered", "requests_per_minute": 2}}}
PROMPT = [(7 + 13 * i) % 380 + 1 for i in range(96)]  # several full pages


def test_key_file_names_tenants_and_refuses_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    keys = TenantKeys.load(path)
    assert keys.tenant("key-a") == Tenant("acme") and keys.tenant("key-one") == Tenant("solo", 1)
    assert keys.tenant("key-") is None and keys.tenant("") is None
    for bad in ("{", '{"keys": {}}', '{"keys": {"k": {"tenant": ""}}}', '{"keys": {"k": {"tenant": "t", '
                '"max_concurrent": 0}}}', '{"keys": {"k": "t"}}', "[]"):
        path.write_text(bad)
        with pytest.raises(ValueError):
            TenantKeys.load(path)


def test_tenant_salt_separates_tenants_whatever_the_client_salt() -> None:
    assert CacheScope("", "s").salt == "s"  # no keys: the client's salt, as before
    salts = {CacheScope(t, s).salt for t in ("a", "b", "a\"") for s in ("", "s", '", "b', "b")}
    assert len(salts) == 12 and not salts & {"", "s", "b"}  # injective, never a bare client salt


def test_limiter_counts_concurrency_and_the_sliding_minute() -> None:
    now = [0.0]
    limiter = TenantLimiter(clock=lambda: now[0])
    solo, metered = Tenant("solo", max_concurrent=1), Tenant("metered", requests_per_minute=2)
    release = limiter.admit(solo)
    with pytest.raises(oa.APIError) as exc:
        limiter.admit(solo)
    assert exc.value.status == 429 and exc.value.headers["Retry-After"] == "1"
    release()
    release()  # idempotent: a second release frees nothing more
    limiter.admit(solo)
    with pytest.raises(oa.APIError):
        limiter.admit(solo)
    limiter.admit(metered)()
    now[0] = 20.0
    limiter.admit(metered)()
    with pytest.raises(oa.APIError) as exc:
        limiter.admit(metered)
    assert exc.value.headers["Retry-After"] == "40"  # the first request leaves the window at t=60
    now[0] = 60.5
    limiter.admit(metered)


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("tenants")
    (folder / "keys.json").write_text(json.dumps(KEYS))
    server = ServeProcess(["--model", str(tiny_llama), "--api-keys", str(folder / "keys.json"), "--admin-api-key",
                           "adm", "--max-total-tokens", "2048", "--page-size", "16"], folder / "serve.log")
    try:
        yield server.wait_ready(180).url
    finally:
        server.stop()


def complete(url: str, key: str, salt: str | None = "shared", **more) -> httpx.Response:
    body = {"prompt": PROMPT[:8] if more.get("ignore_eos") else PROMPT, "max_tokens": 2, "temperature": 0,
            "cache_salt": salt} | more
    return httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def cached(response: httpx.Response) -> tuple[int, dict[str, int]]:
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["cached_tokens_by_tier"]


@pytest.mark.integration
def test_same_prompt_and_salt_never_hit_another_tenants_cache(server: str) -> None:
    first = complete(server, "key-a")
    assert cached(first)[0] == 0
    assert cached(complete(server, "key-a"))[0] >= 64  # within a tenant it hits
    other = complete(server, "key-b")  # same prompt, same cache_salt, another tenant
    assert cached(other) == (0, {"device": 0, "host": 0, "storage": 0})
    assert other.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert cached(complete(server, "key-b", salt="other"))[0] == 0  # a salt subdivides its own tenant
    assert cached(complete(server, "key-b"))[0] >= 64


@pytest.mark.integration
def test_unknown_keys_401_and_admin_routes_refuse_tenant_keys(server: str) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer adm"}):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": [1, 2]}, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for route in ("/admin/storage", "/debug/state"):  # /debug/state shows every tenant's requests
        assert _get(server, route, "key-a").status_code == 403, route
        assert _get(server, route, None).status_code == 401 and _get(server, route, "nope").status_code == 401
        assert _get(server, route, "adm").status_code == 200, route
    assert _get(server, "/debug/state", "adm").json()["running"] == 0


def _get(url: str, route: str, key: str | None) -> httpx.Response:
    return httpx.get(f"{url}{route}", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10)


@pytest.mark.integration
def test_tenant_limits_answer_429_with_retry_after(server: str) -> None:
    assert [complete(server, "key-rpm", max_tokens=1).status_code for _ in range(2)] == [200, 200]
    r = complete(server, "key-rpm", max_tokens=1)
    assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 60, r.text
    assert complete(server, "key-a", max_tokens=1).status_code == 200  # other tenants are not limited
    # Four requests sent at once, each ~0.2 s of decoding: they overlap, so a limit of one admits
    # some and refuses the rest while one runs; the slots are all freed when they end.
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: complete(server, "key-one", max_tokens=370, ignore_eos=True), range(4)))
    statuses = sorted(r.status_code for r in answers)
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    assert all(r.headers["Retry-After"] == "1" for r in answers if r.status_code == 429)
    wait_until(lambda: complete(server, "key-one", max_tokens=1).status_code == 200, "slot freed", 30)


def test_a_bad_key_file_or_an_admin_key_among_tenant_keys_is_a_usage_error(tmp_path: Path, tiny_llama: Path) -> None:
    from tierserve.cli.main import main

    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    assert main(["serve", "--model", str(tiny_llama), "--api-keys", str(path), "--admin-api-key", "key-a",
                 "--port", str(free_port())]) == 2
    path.write_text("{")
    assert main(["router", "--model", str(tiny_llama), "--api-keys", str(path)]) == 2


@pytest.mark.integration
@pytest.mark.slow
def test_through_up_tenants_share_no_pages_and_no_routing_signal(tmp_path: Path) -> None:
    """``up --api-keys``: the router sends the tenant to the nodes, whose KV events then carry
    tenant-separated page keys. Once the router's index holds tenant A's pages of a prompt (a
    route reports them), tenant B's same prompt and salt is routed seeing none of them and
    computes every token: no tier serves it, so it cannot be answered faster because A sent it."""
    (tmp_path / "keys.json").write_text(json.dumps(KEYS))
    port = free_port()
    url, prompt = f"http://127.0.0.1:{port}", [1000 + (i * 37) % 40000 for i in range(256)]

    def seen_by_router() -> bool:
        cached(complete(url, "key-a", prompt=prompt))
        return _last_route(url)["prefill_cached_pages"][0] > 0

    with running_up(port, "--api-keys", str(tmp_path / "keys.json"), "--admin-api-key", "adm",
                    "--prefill-nodes", "2", "--max-total-tokens", "4096"):
        assert cached(complete(url, "key-a", prompt=prompt))[0] == 0
        wait_until(seen_by_router, "the router's index holding tenant A's pages", 60)
        assert cached(complete(url, "key-a", prompt=prompt))[0] >= 192
        assert cached(complete(url, "key-b", prompt=prompt)) == (0, {"device": 0, "host": 0, "storage": 0})
        assert _last_route(url)["prefill_cached_pages"] == [0, 0]
        for route in ("/workers", "/debug/state"):  # admin routes: a tenant key is refused, the admin key opens
            assert _get(url, route, "key-a").status_code == 403 and _get(url, route, "adm").status_code == 200


def _last_route(url: str) -> dict:
    return _get(url, "/debug/state", "adm").json()["routes"][-1]


@pytest.mark.integration
@pytest.mark.slow
def test_decode_only_and_prefill_only_paths_keep_tenants_apart(tiny_llama: Path, tmp_path: Path) -> None:
    """Conditional disaggregation's two one-node paths carry the tenant too: through a router that
    always lets the decode node prefill (a threshold no prompt reaches) and one that never does (so a
    one-token request ends on the prefill node), tenant B's copy of tenant A's prompt and salt
    computes every token on either path while A's repeat hits; ``/debug/state`` names the path."""
    (tmp_path / "keys.json").write_text(json.dumps(KEYS))
    args = ["--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "2048",
            "--page-size", "16"]
    nodes = [NodeProcess(role, args, tmp_path / f"{role}.log") for role in ("prefill", "decode")]
    routers: list[RouterProcess] = []
    try:
        for node in nodes:
            node.wait_ready()
        for threshold in (10**6, 0):
            routers.append(RouterProcess(["--model", str(tiny_llama), "--prefill", nodes[0].address, "--decode",
                                          nodes[1].address, "--api-keys", str(tmp_path / "keys.json"),
                                          "--admin-api-key", "adm", "--disaggregation-threshold", str(threshold)],
                                         tmp_path / f"router-{threshold}.log").wait_ready())
        local, alone = routers
        _isolated_on_path(local.url, "decode_only", PROMPT, max_tokens=2)
        _isolated_on_path(alone.url, "prefill_only", PROMPT[::-1], max_tokens=1)  # not on the prefill node yet
    finally:
        for proc in (*routers, *nodes):
            proc.stop()


def _isolated_on_path(url: str, path: str, prompt: list[int], max_tokens: int) -> None:
    first = complete(url, "key-a", prompt=prompt, max_tokens=max_tokens)
    assert cached(first)[0] == 0 and _last_route(url)["path"] == path
    assert cached(complete(url, "key-a", prompt=prompt, max_tokens=max_tokens))[0] >= 64  # A's repeat hits
    assert _last_route(url)["path"] == path
    other = complete(url, "key-b", prompt=prompt, max_tokens=max_tokens)  # same prompt and salt, tenant B
    assert cached(other) == (0, {"device": 0, "host": 0, "storage": 0}) and _last_route(url)["path"] == path
    assert other.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert cached(complete(url, "key-b", prompt=prompt, max_tokens=max_tokens))[0] >= 64  # B's own repeat hits
    assert _get(url, "/debug/state", "adm").json()["served"][path] == 4
