"""One API request fanned out into backend requests, one per (prompt, choice), run
concurrently; their outputs merged in arrival order."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from tierserve.api import openai as oa
from tierserve.api.backend import Backend, Sibling, Siblings
from tierserve.api.formats import ChoiceResult, Delta, Entries
from tierserve.api.metrics import ApiMetrics
from tierserve.core.outputs import RequestOutput
from tierserve.core.sampling import SamplingParams
from tierserve.core.scope import NO_SCOPE, CacheScope
from tierserve.core.tiers import TIERS


@dataclass
class Job:
    """One engine request: choice ``index`` of the response; ``counts_prompt`` for one choice per
    prompt; ``echo``: the prompt's text, put in front of the choice's text (None: no echo);
    ``sibling``: which of its prompt's ``n`` > 1 choices it is (None when ``n`` is 1)."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    counts_prompt: bool
    scope: CacheScope = NO_SCOPE  # the API key's tenant (it, not the client, decides) and the client's salt
    echo: str | None = None
    sibling: Sibling | None = None


def make_jobs(response_id: str, prompts: list[list[int]], params: SamplingParams, n: int, scope: CacheScope,
              echoes: list[str] | None = None) -> list[Job]:
    """``n`` choices per prompt; with a seed, choice ``i`` uses ``seed + i`` so they differ;
    ``echoes``: each prompt's text to echo; ``scope``: the request's cache namespace. The ``n``
    choices of a prompt are ``Siblings`` (choice 0 leads) when ``n`` > 1."""
    jobs = []
    for p, ids in enumerate(prompts):
        group = Siblings(n) if n > 1 else None
        for i in range(n):
            choice_params = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
            index = p * n + i
            echo = echoes[p] if echoes is not None else None
            sibling = Sibling(i, group) if group is not None else None
            jobs.append(Job(index, f"{response_id}-{index}", ids, choice_params, i == 0, scope, echo, sibling))
    return jobs


class Choices:
    """Runs a response's engine requests concurrently, merges their outputs in arrival order and
    keeps each choice's text and last output (for the response body and its usage)."""

    def __init__(self, backend: Backend, jobs: list[Job], metrics: ApiMetrics, buffered: bool) -> None:
        """``buffered``: the response is sent once every request finished (see ``Backend``)."""
        self._backend, self._jobs, self._metrics, self._buffered = backend, jobs, metrics, buffered
        self._queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()
        self._ready: list[tuple[int, RequestOutput | Exception]] = []
        self._text: dict[int, list[str]] = {j.index: [] for j in jobs}
        self._length: dict[int, int] = {j.index: 0 for j in jobs}
        self._entries: dict[int, Entries] = {j.index: [] for j in jobs}
        self._by_index = {j.index: j for j in jobs}
        self._last: dict[int, RequestOutput] = {}
        self._tasks = [asyncio.create_task(self._pump(job)) for job in jobs]

    async def _pump(self, job: Job) -> None:
        started = prev = time.monotonic()
        last, failed = None, False
        try:
            async for out in self._backend.generate(job.request_id, job.prompt_ids, job.params, job.scope,
                                                    buffered=self._buffered, sibling=job.sibling):
                if out.new_token_ids:
                    now = time.monotonic()
                    (self._metrics.ttft if last is None else self._metrics.itl).observe(now - prev)
                    if last is None:
                        self._metrics.first_token(job.params, now - started)
                    prev = now
                last = out
                self._queue.put_nowait((job.index, out))
        except Exception as exc:
            failed = True
            self._queue.put_nowait((job.index, exc))
        finally:  # also on cancellation: that is the client-gone path, counted as an abort
            self._metrics.request_ended(job.request_id, last, failed, started)

    async def start(self) -> None:
        """Waits until every request produced its first output; raises the first engine rejection,
        so that a bad request is answered with an error status before any stream starts."""
        started: set[int] = set()
        while len(started) < len(self._tasks):
            index, item = await self._queue.get()
            self._ready.append((index, item))
            if isinstance(item, Exception):
                raise item
            started.add(index)

    async def events(self) -> AsyncIterator[Delta]:
        """What every output of every request adds, until all finished; raises a request's error."""
        pending = len(self._tasks)
        while pending:
            index, item = self._ready.pop(0) if self._ready else await self._queue.get()
            if isinstance(item, Exception):
                raise item
            delta = self._delta(self._by_index[index], item)
            self._last[index] = item
            pending -= item.finished
            yield delta

    def _delta(self, job: Job, out: RequestOutput) -> Delta:
        text = out.new_text if job.index in self._last or job.echo is None else job.echo + out.new_text
        offset = self._length[job.index]
        self._text[job.index].append(text)
        self._length[job.index] += len(text)
        entries = _entries(job, out)
        self._entries[job.index] += entries or []
        return Delta(job.index, text, out.reason, entries, offset)

    async def run(self) -> None:
        async for _ in self.events():
            pass

    def cancel(self) -> None:
        """Aborts whatever still runs. Synchronous: it must work inside an already-cancelled task."""
        for task in self._tasks:
            task.cancel()

    def unfinished(self) -> list[int]:
        """The indexes of the choices whose finished output was not among ``events`` yet."""
        return [j.index for j in self._jobs if j.index not in self._last or not self._last[j.index].finished]

    def results(self) -> list[ChoiceResult]:
        return [ChoiceResult(j.index, "".join(self._text[j.index]), _reason(self._last.get(j.index)),
                             self._entries[j.index] if j.params.logprobs is not None else None)
                for j in self._jobs]

    def usage(self) -> oa.Usage:
        outs = [(j, self._last[j.index]) for j in self._jobs if j.index in self._last]
        heads = [o for j, o in outs if j.counts_prompt]  # a prompt counts once however many choices
        by_tier = {t: sum(o.cached_by_tier.get(t, 0) for o in heads) for t in TIERS}
        drafted = sum(o.spec_draft_tokens for _, o in outs)
        spec = oa.SpeculativeUsage(draft_tokens=drafted, accepted_tokens=sum(o.spec_accepted_tokens for _, o in outs))
        return oa.Usage.build(sum(o.prompt_tokens for o in heads), sum(o.completion_tokens for _, o in outs),
                              sum(o.cached_tokens for o in heads), by_tier, spec if drafted else None)


def _reason(out: RequestOutput | None) -> str | None:
    return out.reason if out is not None else None


def _entries(job: Job, out: RequestOutput) -> Entries | None:
    """The output's logprobs in order, echoed prompt first (tokens before the first scored one as bare
    ids); None if not asked."""
    if job.params.logprobs is None:
        return None
    prompt = out.prompt_logprobs
    head: Entries = [lp if lp is not None else t for t, lp in zip(job.prompt_ids, prompt or [], strict=False)]
    return head + list(out.logprobs or [])
