"""Engine behaviour: pool exhaustion, preemption, abort, stops, sampling, validation, prefix hook."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.base import PrefixHit, SingleTier
from tierserve.cache.device_pool import DeviceKVPool
from tierserve.cache.prefetch import PrefetchTicket
from tierserve.core.sampling import InvalidRequestError, SamplingParams
from tierserve.core.scope import NO_SCOPE, CacheScope
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.request import FinishReason

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _engine(model_dir: Path, tokens: int = 2048, page_size: int = 4, **kw) -> Engine:
    cfg = EngineConfig(model_dir, dtype="float32", page_size=page_size, max_total_tokens=tokens, **kw)
    return Engine(cfg, **({"prefix_cache": kw.pop("cache")} if "cache" in kw else {}))


def _prompts(n: int, length: int, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 384, (length + i % 5,), generator=gen).tolist() for i in range(n)]


def _run_all(engine: Engine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_work():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def test_more_requests_than_pages_all_complete_and_pages_return(tiny_llama: Path) -> None:
    prompts = _prompts(12, 20)
    reference = _engine(tiny_llama).generate(prompts, GREEDY)
    # 64 tokens of KV: room for about one request at a time, so most requests queue or get preempted
    small = _engine(tiny_llama, tokens=64, page_size=4)
    assert small.generate(prompts, GREEDY) == reference
    assert small.scheduler.num_preemptions > 0
    stats = small.stats()
    assert stats["kv_pages_used"] == 0
    # the queue-time counters (/metrics): each request once, a preempted one's second wait not counted
    assert stats["admitted_requests"] == 12 and stats["queue_seconds"] > 0
    small.cache.evict(small.allocator.num_pages)
    assert small.allocator.num_used == 0
    small.allocator.check()


def test_request_larger_than_pool_is_rejected_not_queued(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, tokens=64, page_size=4)
    with pytest.raises(InvalidRequestError, match="pool holds 64"):
        engine.add_request("big", list(range(2, 60)), SamplingParams(max_tokens=10))
    assert not engine.has_work()


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([5, 999], SamplingParams(), r"\[0, 384\)"),
        (list(range(2, 300)), SamplingParams(max_tokens=300), "maximum context length is 512"),
    ],
)
def test_invalid_requests(tiny_llama: Path, prompt, params, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        _engine(tiny_llama).add_request("r", prompt, params)


def test_invalid_sampling_params() -> None:
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"stop": [""]}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)


def test_abort_running_request_frees_pages(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    a, b = _prompts(2, 30)
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, GREEDY)
    engine.step()
    engine.step()
    out = engine.abort("a")
    assert out.finished and out.finish_reason is FinishReason.ABORT
    assert engine.abort("a") is None
    outs = _run_all(engine)
    assert set(outs) == {"b"} and outs["b"][-1].completion_tokens == GREEDY.max_tokens
    assert engine.stats()["kv_pages_used"] == 0


def test_abort_waiting_request(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    engine.add_request("w", _prompts(1, 10)[0], GREEDY)
    assert engine.abort("w").finish_reason is FinishReason.ABORT
    assert not engine.has_work() and engine.stats()["kv_pages_used"] == 0


def test_max_tokens_and_stop_token_ids(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    prompt = _prompts(1, 12)[0]
    free_run = engine.generate([prompt], GREEDY)[0]
    stop_at = free_run[5]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    engine.add_request("s", prompt, params)
    last = _run_all(engine)["s"][-1]
    assert last.finish_reason is FinishReason.STOP
    assert last.completion_tokens == free_run.index(stop_at) + 1
    engine.add_request("l", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    last = _run_all(engine)["l"][-1]
    assert last.finish_reason is FinishReason.LENGTH and last.completion_tokens == 3


def test_eos_stops_unless_ignored(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    prompt = _prompts(1, 12)[0]
    free_run = engine.generate([prompt], GREEDY)[0]
    engine.eos_ids = {free_run[3]}
    assert engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0)) == [free_run[:4]]
    assert engine.generate([prompt], GREEDY) == [free_run]


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    prompt = _prompts(1, 12)[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    alone = engine.generate([prompt], params)[0]
    others = _prompts(3, 15, seed=9)
    batched = engine.generate([*others, prompt], params)[-1]
    assert alone == batched
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=8)
    assert engine.generate([prompt], other_seed)[0] != alone


def test_top_k_one_is_greedy(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    prompt = _prompts(1, 12)[0]
    top1 = SamplingParams(max_tokens=16, temperature=1.5, top_k=1, ignore_eos=True)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert engine.generate([prompt], top1) == engine.generate([prompt], greedy)


class DictPrefixCache(SingleTier):
    """A minimal prefix cache for exercising the hook: remembers, for every page boundary of a
    finished request, the pages holding that prefix. It never evicts, so pinning is moot."""

    def __init__(self, allocator: PageAllocator, pool: DeviceKVPool) -> None:
        self.allocator, self.page_size = allocator, pool.page_size
        self.entries: dict[tuple[int, ...], list[int]] = {}
        self.matches = 0

    @property
    def num_cached_pages(self) -> int:
        return len({p for pages in self.entries.values() for p in pages})

    def match(self, token_ids: Sequence[int], ticket: PrefetchTicket | None = None,
              scope: CacheScope = NO_SCOPE) -> PrefixHit:
        pages = len(token_ids) // self.page_size
        for n in range(pages, 0, -1):
            key = tuple(token_ids[: n * self.page_size])
            if key in self.entries:
                self.matches += 1
                return PrefixHit(len(key), list(self.entries[key]), {"device": len(key)})
        return PrefixHit()

    def release(self, token_ids: Sequence[int], pages: list[int], num_computed: int, hit: PrefixHit) -> None:
        full = num_computed // self.page_size
        keys = [tuple(token_ids[: n * self.page_size]) for n in range(len(hit.pages) + 1, full + 1)]
        if any(k in self.entries for k in keys):  # another request cached the same tokens first
            full = len(hit.pages)
        else:
            self.entries.update({k: pages[: len(k) // self.page_size] for k in keys})
        self.allocator.free(pages[full:])

    def evict(self, num_pages: int) -> int:
        return 0

    def on_step(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


def test_prefix_cache_hook_reuses_pages_and_outputs_do_not_change(tiny_llama: Path) -> None:
    engine = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=4, max_total_tokens=2048),
                    prefix_cache=DictPrefixCache)
    prompt = _prompts(1, 30)[0]
    first = engine.generate([prompt], GREEDY)[0]
    engine.add_request("again", prompt, GREEDY)
    outs = _run_all(engine)["again"]
    assert [t for o in outs for t in o.new_token_ids] == first
    assert engine.cache.matches == 1
    assert outs[-1].cached_tokens == 28 and outs[-1].cached_by_tier == {"device": 28}
    extended = prompt + first[:10]
    reference = _engine(tiny_llama).generate([extended], GREEDY)
    assert engine.generate([extended], GREEDY) == reference
    assert engine.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_mostly_agrees_with_float32(tiny_llama: Path, dtype: str) -> None:
    prompt = _prompts(1, 20)[0]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    full = _engine(tiny_llama).generate([prompt], params)[0]
    engine = Engine(EngineConfig(tiny_llama, dtype=dtype, page_size=4, max_total_tokens=512))
    assert engine.pool.buffer.dtype == getattr(torch, dtype)
    assert next(engine.model.parameters()).dtype == getattr(torch, dtype)
    half = engine.generate([prompt], params)[0]
    assert half[:2] == full[:2]  # rounding may flip a later near-tie, not the first tokens
