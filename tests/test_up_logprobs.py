"""Logprobs through the cluster (``tierserve up``: router, prefill node, decode node): prompt
logprobs and the first token's come from the prefill node, the rest from the decode node; all
equal transformers on the built-in model, with and without cache hits, streamed and not."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.logprob_checks import chat_logprobs, echo_completion, generated_logprobs, ids_of, post
from helpers.processes import free_port, running_up

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_logprobs_through_the_cluster_equal_transformers(builtin_model: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_up(port, "--model", str(builtin_model), "--dtype", "float32", "--max-total-tokens", "4096",
                    "--no-l3"):
        ids = post(url, "/tokenize", {"prompt": "The capital of France is Paris. The capital of Italy is Rome, "
                                                "and the capital of Spain is"})["tokens"]
        first = echo_completion(url, builtin_model, ids, k=4)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        hit = generated_logprobs(url, builtin_model, ids, k=3)  # the prompt is now in the prefill node's L1
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        again = echo_completion(url, builtin_model, ids, k=4)  # computed again, not served from the cache
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        late = echo_completion(url, builtin_model, ids, k=2, logprob_start_len=len(ids) - 3)
        assert late["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 4) // 16 * 16 > 0
        chat_ids = post(url, "/tokenize", {"messages": [{"role": "user", "content": "Name a color."}]})["tokens"]
        chat_logprobs(url, builtin_model, chat_ids, k=2)
        body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 0, "return_tokens_as_token_ids": True}
        free = ids_of(post(url, "/v1/completions", body)["choices"][0]["logprobs"]["tokens"])
        held = post(url, "/v1/completions", {**body, "stop_token_ids": [free[0], free[1]], "min_tokens": 3})
        tokens = ids_of(held["choices"][0]["logprobs"]["tokens"])
        assert len(tokens) >= 3 and free[0] != tokens[0] and free[1] not in tokens[:3]
