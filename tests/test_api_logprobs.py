"""Logprobs, echo, min_tokens and token-id output through ``tierserve serve``'s OpenAI API, equal
to transformers on the same weights (tiny Llama and the built-in model), with and without cache hits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from helpers.logprob_checks import chat_logprobs, echo_completion, generated_logprobs, hf_logprobs, ids_of, post
from helpers.processes import ServeProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, builtin_model: Path, tmp_path_factory) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("logprob-logs")
    procs = {
        "tiny": ServeProcess(["--model", str(tiny_llama), "--dtype", "float32", "--max-total-tokens", "2048",
                              "--page-size", "4", "--chunked-prefill-size", "16"], logs / "tiny.log"),
        "smol": ServeProcess(["--model", str(builtin_model), "--dtype", "float32", "--max-total-tokens", "4096",
                              "--context-length", "2048"], logs / "smol.log"),
    }
    try:
        yield {name: p.wait_ready().url for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_echo_logprobs_match_hf_with_and_without_cache(servers: dict[str, str], tiny_llama: Path) -> None:
    """Echo over a 3-chunk prompt equals transformers; a repeat (its prefix now cached) is computed
    again (cached_tokens 0) and equal; logprobs of generated tokens alone do use the cache."""
    url, prompt = servers["tiny"], _prompt(40, 1)
    first = echo_completion(url, tiny_llama, prompt, k=4)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = echo_completion(url, tiny_llama, prompt, k=4)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]
    hit = generated_logprobs(url, tiny_llama, prompt, k=3)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= 36
    late = echo_completion(url, tiny_llama, prompt, k=2, logprob_start_len=30)  # SGLang's extension
    assert late["usage"]["prompt_tokens_details"]["cached_tokens"] == 28  # pages of 4 before position 29
    generated_logprobs(url, tiny_llama, _prompt(11, 2), k=0)


def test_builtin_model_echo_and_chat_match_hf(servers: dict[str, str], builtin_model: Path) -> None:
    url = servers["smol"]
    ids = post(url, "/tokenize", {"prompt": "The capital of France is Paris. The capital of Spain is"})["tokens"]
    echo_completion(url, builtin_model, ids, k=5)
    chat_ids = post(url, "/tokenize", {"messages": [{"role": "user", "content": "Name a color."}]})["tokens"]
    chat_logprobs(url, builtin_model, chat_ids, k=3)


def test_text_shape(servers: dict[str, str], builtin_model: Path) -> None:
    """Tokens as text: echo puts the prompt in front, tokens join into the text, offsets point into it."""
    prompt = "One, two, three,"
    out = post(servers["smol"], "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                    "logprobs": 1, "echo": True})["choices"][0]
    lp = out["logprobs"]
    assert out["text"].startswith(prompt) and "".join(lp["tokens"]) == out["text"]
    assert all(out["text"][o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"], strict=True))
    assert all(len(d) in (1, 2) for d in lp["top_logprobs"][1:])


def test_echo_without_logprobs_and_no_logprobs(servers: dict[str, str]) -> None:
    url = servers["smol"]
    out = post(url, "/v1/completions", {"prompt": "Hello there", "max_tokens": 2, "echo": True})["choices"][0]
    assert out["text"].startswith("Hello there") and out["logprobs"] is None
    chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat["choices"][0]["logprobs"] is None


def test_min_tokens_holds_back_stop_ids_and_strings(servers: dict[str, str], tiny_llama: Path) -> None:
    url, prompt = servers["tiny"], _prompt(9, 3)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    first = ids_of(post(url, "/v1/completions", body)["choices"][0]["logprobs"]["tokens"])[0]
    stopped = post(url, "/v1/completions", {**body, "stop_token_ids": [first]})
    assert stopped["usage"]["completion_tokens"] == 1
    held = post(url, "/v1/completions", {**body, "stop_token_ids": [first], "min_tokens": 5})
    tokens = ids_of(held["choices"][0]["logprobs"]["tokens"])
    assert len(tokens) >= 5 and first not in tokens[:5]
    ref = hf_logprobs(tiny_llama, prompt + tokens)[len(prompt) - 1 :]
    assert abs(held["choices"][0]["logprobs"]["token_logprobs"][0] - float(ref[0][tokens[0]])) < 1e-4


def test_min_tokens_holds_back_stop_strings(servers: dict[str, str]) -> None:
    url, body = servers["smol"], {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 6, "temperature": 0}
    free = post(url, "/v1/completions", body)["choices"][0]["text"]
    stop = free.split()[0]
    stopped = post(url, "/v1/completions", {**body, "stop": [stop]})
    assert stopped["choices"][0]["text"] == free[: free.index(stop)]
    need = stopped["usage"]["completion_tokens"] + 2
    held = post(url, "/v1/completions", {**body, "stop": [stop], "min_tokens": need})
    assert held["usage"]["completion_tokens"] >= need
    assert held["choices"][0]["text"].startswith(free[: free.index(stop) + len(stop)])


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 21}),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": -1}),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": True}),
    ("/v1/completions", {"prompt": [1, 2], "echo": "yes"}),
    ("/v1/completions", {"prompt": [1, 2], "min_tokens": 17}),  # above the default max_tokens 16
    ("/v1/completions", {"prompt": [1, 2], "min_tokens": -1}),
    ("/v1/completions", {"prompt": [1, 2], "return_tokens_as_token_ids": "x"}),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 1, "echo": True, "logprob_start_len": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": 3}),
])
def test_bad_values_are_400(servers: dict[str, str], path: str, body: dict) -> None:
    r = httpx.post(servers["smol"] + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
