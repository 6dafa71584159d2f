"""Logprob checks through the OpenAI API of any running server (``serve`` or the router of ``up``)
against transformers on the same weights: shared by the single-engine and the cluster tests."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import httpx
import torch

TOL = 1e-4


@cache
def hf_model(model_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 log-softmax of transformers' logits: row i predicts token i+1."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(model_dir)(torch.tensor([ids])).logits[0].float(), dim=-1)


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def ids_of(tokens: list[str]) -> list[int]:
    """Token ids back from ``return_tokens_as_token_ids`` strings."""
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.removeprefix("token_id:")) for t in tokens]


def check_completion_logprobs(lp: dict, ids: list[int], scored_from: int, k: int, ref: torch.Tensor) -> None:
    """``lp`` (OpenAI completions shape, tokens as ids) scores ``ids`` as ``ref`` does (row i scores
    token i); entries before ``scored_from`` (an echoed first token) are null; each top_logprobs
    dict holds the chosen token plus the k best."""
    assert ids_of(lp["tokens"]) == ids and len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][:scored_from] == [None] * scored_from == lp["top_logprobs"][:scored_from]
    for i in range(scored_from, len(ids)):
        row = ref[i]
        assert abs(lp["token_logprobs"][i] - float(row[ids[i]])) < TOL
        values, best = row.topk(k)
        want = {f"token_id:{t}": float(v) for t, v in zip(best.tolist(), values, strict=True)}
        want[f"token_id:{ids[i]}"] = float(row[ids[i]])
        got = lp["top_logprobs"][i]
        assert set(got) == set(want)
        assert max(abs(got[t] - want[t]) for t in want) < TOL
    assert lp["text_offset"] == sorted(lp["text_offset"])


def echo_completion(url: str, model_dir: Path, prompt: list[int], k: int = 3, max_tokens: int = 4,
                    **extra) -> dict:
    """An echo + logprobs completion of ``prompt`` (token ids), checked against transformers,
    streamed and not (the same logprobs); returns the non-streamed response. ``extra`` may hold
    ``logprob_start_len``: the tokens before it come back unscored."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": k, "echo": True,
            "ignore_eos": True, "return_tokens_as_token_ids": True, **extra}
    out = post(url, "/v1/completions", body)
    lp = out["choices"][0]["logprobs"]
    ids = ids_of(lp["tokens"])
    assert ids[: len(prompt)] == prompt and len(ids) == len(prompt) + max_tokens
    start = max(1, extra.get("logprob_start_len") or 1)
    check_completion_logprobs(lp, ids, start, k, _shift(hf_logprobs(model_dir, ids)))
    chunks = [c["choices"][0] for c in stream(url, "/v1/completions", body) if c["choices"]]
    streamed = {key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]]
                for key in ("tokens", "token_logprobs", "top_logprobs")}
    assert streamed == {key: lp[key] for key in streamed}
    return out


def _shift(ref: torch.Tensor) -> torch.Tensor:
    """Rows indexed by the position predicted: row i scores token i (row 0 unused)."""
    return torch.cat([ref[:1], ref[:-1]])


def generated_logprobs(url: str, model_dir: Path, prompt: list[int], k: int = 2, max_tokens: int = 5) -> dict:
    """A completion with logprobs of the generated tokens only, checked against transformers."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": k, "ignore_eos": True,
            "return_tokens_as_token_ids": True}
    out = post(url, "/v1/completions", body)
    lp = out["choices"][0]["logprobs"]
    ids = ids_of(lp["tokens"])
    check_completion_logprobs(lp, ids, 0, k, _shift(hf_logprobs(model_dir, prompt + ids))[len(prompt):])
    return out


def chat_logprobs(url: str, model_dir: Path, prompt_ids: list[int], k: int = 2) -> None:
    """Chat logprobs (streamed and not) score the answer as transformers does on the rendered prompt."""
    body = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 5, "temperature": 0,
            "logprobs": True, "top_logprobs": k, "ignore_eos": True, "return_tokens_as_token_ids": True}
    content = post(url, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    ids = ids_of([c["token"] for c in content])
    ref = hf_logprobs(model_dir, prompt_ids + ids)[len(prompt_ids) - 1 :]
    for c, t, row in zip(content, ids, ref, strict=False):
        assert abs(c["logprob"] - float(row[t])) < TOL and c["bytes"] == list(c["token"].encode())
        values, best = row.topk(k)
        assert [a["token"] for a in c["top_logprobs"]] == [f"token_id:{b}" for b in best.tolist()]
        assert max(abs(a["logprob"] - float(v)) for a, v in zip(c["top_logprobs"], values, strict=True)) < TOL
    chunks = [c["choices"][0] for c in stream(url, "/v1/chat/completions", body) if c["choices"]]
    streamed = [e for c in chunks if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]  # now from the cache: within TOL
    assert max(abs(e["logprob"] - f["logprob"]) for e, f in zip(streamed, content, strict=True)) < TOL
