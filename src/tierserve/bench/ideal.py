"""The ideal hit rate of a run: what an unbounded prefix cache would have hit on the prompts it sent.

The definition (``IdealCache.send`` and ``ideal_cached_tokens`` hold it):

* Prompts are taken in the order the run sent them (``sent_at``, then ``index``), failed ones
  included: a failed request was still sent, so the ideal cache sees it. The report then sums
  achieved and ideal cached tokens, and prompt tokens, over the successful requests only (as
  ``hit_rate`` does), so ``efficiency = hit_rate / ideal_hit_rate = cached / ideal cached`` over the
  same requests.
* A request's ideal cached tokens are the whole pages (``page_size`` tokens each; the server's
  page size, 16 by default) at the start of its prompt that an earlier prompt with the same
  ``cache_salt`` also started with, counted among the pages of all tokens but the last: a server
  computes at least the last prompt token (its logits give the first output token), so it never
  reuses it (tierserve's scheduler matches ``prompt[:-1]``). A 32-token prompt sent twice hits 16
  tokens the second time, a 33-token one 32.
* After its lookup, every whole page of the prompt (the last token's page included) is cached,
  at once and forever: as if prefill were instant and memory unbounded (so requests in flight
  together already share, which no real server can do). Prompts with different
  salts never share (tenants are separate), as on the server.
* The ids are the ones the server saw: token-id prompts as sent; text and chat prompts as the
  server's ``POST /tokenize`` makes them. Where those are unknown (no /tokenize, an error) or
  disagree with the server's own ``prompt_tokens`` for a successful request, the ideal is None and
  ``meta["ideal"]["note"]`` says why.

What it leaves out can put ``efficiency`` above 1: generated tokens (a server that caches its
answers hits them in the next round of a text or chat conversation) and KV cached before the run
(a warm server; a fresh ``cache_salt`` per run rules that out)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import httpx

from tierserve.bench.client import ClientConfig, TokenizeError, tokenize
from tierserve.bench.records import Prompt, RequestRecord

DEFAULT_PAGE_SIZE = 16  # tierserve's default --page-size
TOKENIZE_CONCURRENCY = 16  # /tokenize calls in flight after the run: quick, but not thousands at once


class IdealCache:
    """An unbounded prefix cache of whole pages: a trie per salt whose edges are pages. Nodes are
    integers keyed by (parent, page), so a lookup costs one dict probe per page, whatever the depth."""

    def __init__(self, page_size: int = DEFAULT_PAGE_SIZE) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.page_size = page_size
        self._roots: dict[str, int] = {}
        self._edges: dict[tuple[int, tuple[int, ...]], int] = {}

    def send(self, ids: Sequence[int], salt: str = "") -> int:
        """The cached tokens of a request for ``ids`` (whole pages of ``ids[:-1]`` cached before),
        then caches every whole page of ``ids``."""
        node, found = self._root(salt), 0
        for page in self.pages(ids):
            child = self._edges.get((node, page))
            if child is None:  # a new node has no children: every later page misses too
                child = self._edges[(node, page)] = self._new_node()
            else:
                found += 1
            node = child
        usable = max(0, len(ids) - 1) // self.page_size  # the pages that leave the last token out
        return min(found, usable) * self.page_size

    def pages(self, ids: Sequence[int]) -> Iterator[tuple[int, ...]]:
        """The whole pages of ``ids``; a partial last page is never cached."""
        size = self.page_size
        return (tuple(ids[i:i + size]) for i in range(0, len(ids) - size + 1, size))

    def _root(self, salt: str) -> int:
        if salt not in self._roots:
            self._roots[salt] = self._new_node()
        return self._roots[salt]

    def _new_node(self) -> int:
        return len(self._roots) + len(self._edges)


def ideal_cached_tokens(prompts: Iterable[tuple[Sequence[int], str]], page_size: int = DEFAULT_PAGE_SIZE) -> list[int]:
    """Each prompt's ideal cached tokens, for (token ids, cache salt) pairs in send order."""
    cache = IdealCache(page_size)
    return [cache.send(ids, salt) for ids, salt in prompts]


def send_order(records: list[RequestRecord]) -> list[RequestRecord]:
    """``records`` as the run sent them: by ``sent_at``, ties (and never-sent records) by index."""
    return sorted(records, key=lambda r: (r.sent_at, r.index))


def cache_salt(extra_body: dict[str, Any]) -> str:
    """The salt the server applies to every request of the run ("" when none, as on the server)."""
    salt = extra_body.get("cache_salt")
    return "" if salt is None else str(salt)


async def fill_ideal(client: httpx.AsyncClient, config: ClientConfig, records: list[RequestRecord],
                     prompts: dict[int, Prompt], page_size: int) -> dict[str, Any]:
    """Sets every record's ``ideal_cached_tokens`` (``prompts`` maps a record's index to what it
    sent) and returns ``meta["ideal"]``: {page_size, source of the ids, note (why there is no
    ideal, or None)}. On failure every record keeps None."""
    ordered = send_order(records)
    sent = [prompts[r.index] for r in ordered]
    source = "prompt token ids" if all(_is_ids(p) for p in sent) else "the server's /tokenize"
    meta: dict[str, Any] = {"page_size": page_size, "source": source, "note": None}
    try:
        ids = await prompt_ids(client, config, sent)
    except TokenizeError as exc:
        meta["note"] = f"no token ids for the text prompts (/tokenize failed: {exc})"
        return meta
    meta["note"] = count_mismatch(ordered, ids)
    if meta["note"] is None:
        salt = cache_salt(config.extra_body)
        for record, cached in zip(ordered, ideal_cached_tokens(((x, salt) for x in ids), page_size), strict=True):
            record.ideal_cached_tokens = cached
    return meta


async def prompt_ids(client: httpx.AsyncClient, config: ClientConfig, prompts: list[Prompt]) -> list[list[int]]:
    """The token ids of each prompt as the server saw them: token ids as they are, text and chat
    through the server's /tokenize. Raises ``TokenizeError``."""
    # Each distinct text once: multi-turn runs resend histories, shared-prefix runs share prompts.
    texts = {repr(p): p for p in prompts if not _is_ids(p)}
    gate = asyncio.Semaphore(TOKENIZE_CONCURRENCY)

    async def one(prompt: Prompt) -> list[int]:
        async with gate:
            return await tokenize(client, config, prompt)

    # return_exceptions: every call finishes before a failure is raised, so none is left running.
    done = await asyncio.gather(*(one(p) for p in texts.values()), return_exceptions=True)
    failure = next((r for r in done if isinstance(r, BaseException)), None)
    if failure is not None:
        raise failure
    by_text = dict(zip(texts, done, strict=True))
    return [list(p) if _is_ids(p) else by_text[repr(p)] for p in prompts]  # type: ignore[arg-type]


def count_mismatch(records: list[RequestRecord], ids: list[list[int]]) -> str | None:
    """Why ``ids`` cannot be the prompts the server saw: the first successful record whose
    ``prompt_tokens`` differ from its ids' length (None when all agree). Such ids would make an
    ideal of some other prompts."""
    for record, x in zip(records, ids, strict=True):
        if record.ok and record.prompt_tokens != len(x):
            return (f"the server counted {record.prompt_tokens} prompt tokens for request {record.index}, "
                    f"its token ids have {len(x)}: no ideal of prompts it did not see")
    return None


def _is_ids(prompt: Prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
