"""Unit tests of tierserve.bench's ideal hit rate: the unbounded page cache on hand-made prompts
(shared prefixes, partial pages, salts, repeats, the last-token rule) against a brute-force
definition, the report's ``ideal_hit_rate`` and ``efficiency``, and the runner getting the ids of
text and chat prompts from a stand-in server's /tokenize (or saying why it has none)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tierserve.bench.compare import compare, metric_rows
from tierserve.bench.ideal import IdealCache, cache_salt, count_mismatch, ideal_cached_tokens, send_order
from tierserve.bench.records import RequestRecord
from tierserve.bench.report import Report, efficiency, ideal_hit_rate
from tierserve.bench.runner import BenchOptions, run_bench_async
from tierserve.bench.tokens import TokenSpace
from tierserve.bench.workloads import MultiTurnConfig, SharedPrefixConfig, multiturn, shared_prefix

SPACE = TokenSpace(384, 32)


def ideal(prompts: list[list[int]], page_size: int = 4, salts: list[str] | None = None) -> list[int]:
    return ideal_cached_tokens(zip(prompts, salts or [""] * len(prompts), strict=True), page_size)


def brute_force(prompts: list[list[int]], salts: list[str], page: int) -> list[int]:
    """The definition, quadratically: the longest common prefix with an earlier prompt of the same
    salt, in whole pages, but never reaching the last token."""
    out = []
    for i, (p, salt) in enumerate(zip(prompts, salts, strict=True)):
        common = max([_common(p, q) for q, s in zip(prompts[:i], salts[:i], strict=True) if s == salt] + [0])
        out.append(min(common // page, max(0, len(p) - 1) // page) * page)
    return out


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_prefixes_hit_their_whole_common_pages_only() -> None:
    a = list(range(100, 112))  # 3 pages of 4
    b = [*a[:6], 7, 8, 9, 10, 11, 12]  # shares a page and a half
    c = [*a[:8], 1, 2, 3, 4]  # shares two pages
    assert ideal([a, b, c]) == [0, 4, 8]


def test_a_partial_last_page_is_never_cached() -> None:
    a = list(range(100, 110))  # 2 whole pages + 2 tokens
    longer = [*a, 1, 2, 3, 4, 5, 6]  # extends a: only a's whole pages were cached
    assert ideal([a, longer]) == [0, 8]
    assert ideal([a, longer, longer]) == [0, 8, 12]  # 16 tokens: the last page holds the last token


def test_the_last_prompt_token_is_never_counted() -> None:
    for n, second in ((8, 4), (9, 8), (4, 0), (5, 4), (1, 0), (0, 0)):
        prompt = list(range(200, 200 + n))
        assert ideal([prompt, prompt]) == [0, second], n
    whole = list(range(300, 316))
    assert ideal([whole, whole[:9]]) == [0, 8]  # a prefix of a cached prompt: all pages before its last token


def test_repeated_identical_prompts_hit_the_same_each_time() -> None:
    prompt = list(range(50, 83))  # 33 tokens, pages of 16: 32 reusable
    assert ideal([prompt] * 4, page_size=16) == [0, 32, 32, 32]


def test_salts_separate_tenants() -> None:
    prompt = list(range(60, 80))
    assert ideal([prompt] * 4, salts=["a", "b", "a", ""]) == [0, 0, 16, 0]
    assert ideal([prompt] * 2, salts=["", ""]) == [0, 16]


def test_the_cache_matches_the_brute_force_definition() -> None:
    rng = random.Random(0)
    for page in (1, 2, 4, 16):
        stems = [[rng.randrange(3) for _ in range(rng.randrange(40))] for _ in range(6)]
        prompts = [rng.choice(stems)[:rng.randrange(41)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
                   for _ in range(120)]  # a 3-token vocabulary: many accidental common prefixes too
        salts = [rng.choice(["", "x"]) for _ in prompts]
        assert ideal(prompts, page, salts) == brute_force(prompts, salts, page), page


def test_page_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        IdealCache(0)
    with pytest.raises(ValueError):
        BenchOptions(page_size=0)


def record(index: int, prompt: int, cached: int, ideal_cached: int | None, ok: bool = True,
           sent_at: float = 0.0) -> RequestRecord:
    return RequestRecord(index=index, tags={}, scheduled_at=0, sent_at=sent_at, ok=ok, prompt_tokens=prompt,
                         cached_tokens=cached, cached_by_tier={"device": cached, "host": 0, "storage": 0},
                         ideal_cached_tokens=ideal_cached, error=None if ok else "boom")


def test_send_order_and_salt() -> None:
    records = [record(0, 1, 0, 0, sent_at=0.3), record(1, 1, 0, 0, sent_at=0.1), record(2, 1, 0, 0, sent_at=0.1)]
    assert [r.index for r in send_order(records)] == [1, 2, 0]
    assert cache_salt({}) == "" and cache_salt({"cache_salt": "t1"}) == "t1" and cache_salt({"cache_salt": None}) == ""


def test_report_efficiency_is_achieved_over_ideal(tmp_path: Path) -> None:
    records = [record(0, 100, 0, 0), record(1, 100, 30, 60), record(2, 200, 60, 90),
               record(3, 500, 0, 400, ok=False)]  # failed: out of every sum
    report = Report(records, 1.0, {"ideal": {"page_size": 16, "source": "prompt token ids", "note": None}})
    s = report.summary()
    assert s["hit_rate"] == pytest.approx(90 / 400) and s["ideal_hit_rate"] == pytest.approx(150 / 400)
    assert s["efficiency"] == pytest.approx(s["hit_rate"] / s["ideal_hit_rate"]) == pytest.approx(90 / 150)
    assert s["tokens"]["ideal_cached"] == 150
    table = report.table()
    assert "ideal hit rate: 37.5% (unbounded prefix cache over the prompts sent, 16-token pages)" in table
    assert "efficiency 60.0%" in table
    report.to_json(tmp_path / "r.json")
    again = Report.from_json(tmp_path / "r.json").summary()
    assert again["ideal_hit_rate"] == s["ideal_hit_rate"] and again["efficiency"] == s["efficiency"]
    rows = {label: (a, b) for label, a, b, _ in metric_rows(s, again)}
    assert rows["ideal hit rate"] == pytest.approx((37.5, 37.5)) and rows["efficiency"] == pytest.approx((60, 60))
    assert "efficiency (%)" in compare(report, report)


def test_ideal_is_none_when_unknown_or_zero() -> None:
    unknown = [record(0, 100, 0, 0), record(1, 100, 20, None)]
    assert ideal_hit_rate(unknown) is None and Report(unknown, 1.0, {}).summary()["efficiency"] is None
    assert Report(unknown, 1.0, {}).summary()["tokens"]["ideal_cached"] is None
    note = {"ideal": {"note": "no token ids (HTTP 404)"}}
    assert "ideal hit rate: - (no token ids (HTTP 404))" in Report(unknown, 1.0, note).table()
    nothing = [record(0, 100, 0, 0), record(1, 100, 0, 0)]
    assert ideal_hit_rate(nothing) == 0 and efficiency(0.0, 0.0) is None
    assert ideal_hit_rate([]) is None and efficiency(None, 0.5) is None
    assert efficiency(0.2, 0.4) == pytest.approx(0.5)
    # Reports written before the ideal existed: no field, no ideal, and compare still works.
    old = {k: v for k, v in record(0, 10, 0, 0).to_json().items() if k != "ideal_cached_tokens"}
    assert RequestRecord.from_json(old).ideal_cached_tokens is None


def test_count_mismatch_names_the_first_disagreeing_successful_request() -> None:
    records = [record(0, 5, 0, None, ok=False), record(1, 4, 0, None)]
    assert count_mismatch(records, [[1, 2], [1, 2, 3, 4]]) is None  # a failed request counted nothing
    note = count_mismatch(records, [[1, 2], [1, 2, 3]])
    assert note is not None and "request 1" in note and "4 prompt tokens" in note


class WordServer:
    """A stand-in OpenAI server: token ids as they come, one token per word of text (chat: per role
    and word), a cache of whole 4-token pages holding only the latest prompt (so it misses what an
    unbounded cache hits), and /tokenize unless ``tokenize`` is False. ``miscount`` adds to its
    reported prompt tokens; ``fail_every`` answers every n-th generation with a 429."""

    def __init__(self, tokenize: bool = True, miscount: int = 0, fail_every: int = 0) -> None:
        self.tokenize, self.miscount, self.fail_every = tokenize, miscount, fail_every
        self.vocab: dict[str, int] = {}
        self.last: list[int] = []
        self.generations = 0
        self.tokenize_bodies: list[dict] = []

    def ids(self, body: dict) -> list[int]:
        if isinstance(body.get("prompt"), list):
            return body["prompt"]
        words = body["prompt"].split() if "prompt" in body else [
            w for m in body["messages"] for w in [f"<{m['role']}>", *m["content"].split()]]
        return [self.vocab.setdefault(w, len(self.vocab)) for w in words]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path, body = request.url.path, json.loads(request.content or b"{}")
        if path == "/tokenize" and self.tokenize:
            self.tokenize_bodies.append(body)
            return httpx.Response(200, json={"tokens": self.ids(body), "count": len(self.ids(body))})
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return httpx.Response(404, json={"detail": "Not Found"})
        self.generations += 1
        if self.fail_every and self.generations % self.fail_every == 0:
            return httpx.Response(429, json={"error": {"message": "overloaded"}})
        return httpx.Response(200, content=self.events(self.ids(body)))

    async def events(self, ids: list[int]) -> AsyncIterator[bytes]:
        cached = min(_common(ids, self.last), len(ids) - 1) // 4 * 4
        self.last = ids
        yield _sse({"choices": [{"index": 0, "text": " a", "finish_reason": "length"}]})
        usage = {"prompt_tokens": len(ids) + self.miscount, "completion_tokens": 1,
                 "prompt_tokens_details": {"cached_tokens": cached},
                 "cached_tokens_by_tier": {"device": cached, "host": 0, "storage": 0}}
        yield _sse({"choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def bench(server: WordServer, workload, **options) -> Report:
    opts = BenchOptions(clients=1, progress=False, model="m", page_size=4, **options)
    return asyncio.run(run_bench_async("http://fake/v1", workload, opts, httpx.MockTransport(server.handle)))


def sent_ids(server: WordServer, workload) -> list[list[int]]:
    """The server's ids of a one-shot workload's prompts, in the order one closed-loop client sends them."""
    prompts = [s.first().prompt for s in workload.sessions]
    return [server.ids({"prompt": p} if isinstance(p, str) else {"messages": p}) for p in prompts]


def groups(style: str) -> object:
    config = SharedPrefixConfig(groups=3, prompts_per_group=4, system_length=10, question_length=3, output_length=1)
    return shared_prefix(config, style, SPACE, seed=0)


@pytest.mark.parametrize("style", ["text", "chat"])
def test_text_and_chat_prompts_are_tokenized_by_the_server(style: str) -> None:
    server = WordServer()
    report = bench(server, groups(style), extra_body={"cache_salt": "s"})
    s = report.summary()
    assert report.meta["ideal"] == {"page_size": 4, "source": "the server's /tokenize", "note": None}
    assert len(server.tokenize_bodies) == 12 and all(b["model"] == "m" for b in server.tokenize_bodies)
    assert all(("prompt" in b) == (style == "text") for b in server.tokenize_bodies)
    expected = ideal(sent_ids(server, groups(style)), 4)
    assert [r.ideal_cached_tokens for r in send_order(report.records)] == expected
    assert sum(expected) > 0 and s["ideal_hit_rate"] == pytest.approx(sum(expected) / s["tokens"]["prompt"])
    assert s["hit_rate"] < s["ideal_hit_rate"]  # the server keeps one prompt only
    assert s["efficiency"] == pytest.approx(s["hit_rate"] / s["ideal_hit_rate"]) and 0 < s["efficiency"] < 1


def test_token_prompts_need_no_tokenize_and_match_a_perfect_cache() -> None:
    server = WordServer(tokenize=False)
    config = MultiTurnConfig(clients=1, rounds=4, context_length=20, question_length=5, output_length=1)
    report = bench(server, multiturn(config, "tokens", SPACE, seed=0))
    s = report.summary()
    assert report.meta["ideal"]["source"] == "prompt token ids" and not server.tokenize_bodies
    # One conversation at a time: the latest prompt is all an unbounded cache would reuse too.
    assert s["ideal_hit_rate"] > 0.5 and s["efficiency"] == pytest.approx(1.0)


def test_without_tokenize_the_ideal_is_unknown_and_says_why() -> None:
    report = bench(WordServer(tokenize=False), groups("text"))
    s = report.summary()
    assert s["hit_rate"] is not None and s["ideal_hit_rate"] is None and s["efficiency"] is None
    assert all(r.ideal_cached_tokens is None for r in report.records)
    note = report.meta["ideal"]["note"]
    assert "/tokenize failed: HTTP 404" in note and note in report.table()


def test_ids_that_disagree_with_the_servers_count_give_no_ideal() -> None:
    report = bench(WordServer(miscount=1), groups("text"))
    assert report.summary()["ideal_hit_rate"] is None
    assert "the server counted" in report.meta["ideal"]["note"]


def test_failed_requests_feed_the_ideal_cache_but_no_sum() -> None:
    server = WordServer(fail_every=3)
    report = bench(server, groups("text"))
    failed = [r for r in report.records if not r.ok]
    assert failed and all(r.ideal_cached_tokens is not None for r in report.records)
    ok = report.ok
    s = report.summary()
    assert s["tokens"]["ideal_cached"] == sum(r.ideal_cached_tokens for r in ok)
    assert s["ideal_hit_rate"] == pytest.approx(s["tokens"]["ideal_cached"] / sum(r.prompt_tokens for r in ok))
    replay = ideal(sent_ids(server, groups("text")), 4)  # failed ones included, in send order
    assert [r.ideal_cached_tokens for r in send_order(report.records)] == replay


def test_cli_passes_the_page_size() -> None:
    from tierserve.cli.bench import bench_options
    from tierserve.cli.main import build_parser

    parser = build_parser()
    assert bench_options(parser.parse_args(["bench", "run", "multiturn"])).page_size == 16
    assert bench_options(parser.parse_args(["bench", "run", "multiturn", "--page-size", "32"])).page_size == 32
