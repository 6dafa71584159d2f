"""In-flight sharing (docs/cache.md): requests admitted together that share a prefix compute it once
(chunk pages join the tree as computed, a waiting request is held back for pages another request is
computing), n copies of one prompt compute it once, and the cache report stays exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierserve.cache.options import HiCacheOptions
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig, SchedulePolicy
from tierserve.engine.engine import Engine

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PAGE = 4
PREFIX, QUESTION = 96, 6  # tokens: the shared prefix (24 pages) and each request's own tail


def _engine(model_dir: Path, chunk: int = 2048, **kw) -> Engine:
    cfg = EngineConfig(model_dir, dtype="float32", page_size=PAGE, max_total_tokens=4096,
                       chunked_prefill_size=chunk, **kw)
    return Engine(cfg)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _shared(n: int) -> list[list[int]]:
    prefix = _tokens(PREFIX, 0)
    return [prefix + _tokens(QUESTION, 100 + i) for i in range(n)]


def _one_by_one(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    engine = _engine(model_dir, disable_radix_cache=True)
    return [engine.generate([p], GREEDY)[0] for p in prompts]


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Adds every prompt before the first step (admitted together); outputs and cached tokens."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, GREEDY)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    cached: dict[str, int] = {}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.cached_tokens
    return [out[r] for r in ids], [cached[r] for r in ids]


@pytest.mark.parametrize("hierarchical", [False, True])
def test_concurrent_shared_prefix_is_computed_once(tiny_llama: Path, hierarchical: bool) -> None:
    prompts = _shared(6)
    engine = _engine(tiny_llama, enable_hierarchical_cache=hierarchical, hicache=HiCacheOptions(ratio=2.0))
    outputs, cached = _run(engine, prompts)
    assert outputs == _one_by_one(tiny_llama, prompts)
    # the first computes everything; each other one hits the prefix's full pages, once, on the device
    assert cached == [0] + [PREFIX] * 5
    assert engine.prefill_tokens_computed == sum(len(p) for p in prompts) - 5 * PREFIX
    assert engine.scheduler.num_held >= 5
    assert engine.stats()["kv_pages_used"] == 0


def test_without_hold_back_fcfs_computes_it_for_each(tiny_llama: Path) -> None:
    """The held-back rule is what makes it once: a cache that cannot share in flight (none) holds
    nobody back, so requests admitted together each compute the prefix."""
    prompts = _shared(4)
    engine = _engine(tiny_llama, disable_radix_cache=True, schedule_policy=SchedulePolicy.FCFS)
    _, cached = _run(engine, prompts)
    assert cached == [0] * 4
    assert engine.prefill_tokens_computed == sum(len(p) for p in prompts)
    assert engine.scheduler.num_held == 0


def test_n_copies_compute_the_prompt_once(tiny_llama: Path) -> None:
    """``n`` choices are n requests of one prompt: the first computes it, the others fork its pages and
    compute only the last partial page and the last token (at most ``page_size`` tokens each)."""
    prompt = _tokens(PREFIX + 3, 7)
    engine = _engine(tiny_llama)
    outputs, cached = _run(engine, [prompt] * 8)
    assert outputs == _one_by_one(tiny_llama, [prompt]) * 8
    full = (len(prompt) - 1) // PAGE * PAGE
    assert cached == [0] + [full] * 7
    assert engine.prefill_tokens_computed == len(prompt) + 7 * (len(prompt) - full)


def test_chunks_are_shared_as_computed_and_the_wait_is_bounded(tiny_llama: Path) -> None:
    """With a prompt of several chunks, a request that arrives while the first is mid-prefill hits
    the chunks computed so far plus those computed while it was held; it is held at most as many
    steps as computing the prefix would take."""
    prompts = _shared(2)
    engine = _engine(tiny_llama, chunk=32)
    engine.add_request("a", prompts[0], GREEDY)
    engine.step()  # the first chunk of "a" (32 tokens): its 8 pages are in the tree now
    assert engine.cache.cached_prefix(prompts[1]) == 8
    engine.add_request("b", prompts[1], GREEDY)
    cached = {}
    while engine.has_work():
        cached |= {o.request_id: o.cached_tokens for o in engine.step()}
    assert cached == {"a": 0, "b": PREFIX}
    assert engine.scheduler.num_held <= -(-PREFIX // 32)


def test_lpm_admits_the_longest_cached_prefix_first(tiny_llama: Path) -> None:
    """``lpm`` admits a request whose prefix is cached before an earlier one with nothing cached;
    ``fcfs`` keeps arrival order (the first takes the whole prefill budget)."""
    prompts = _shared(2)
    other = _tokens(len(prompts[1]), 55)
    for policy, first in ((SchedulePolicy.LPM, "hit"), (SchedulePolicy.FCFS, "miss")):
        engine = _engine(tiny_llama, chunk=len(other), schedule_policy=policy)
        engine.generate([prompts[0]], GREEDY)
        engine.add_request("miss", other, GREEDY)
        engine.add_request("hit", prompts[1], GREEDY)
        engine.step()
        assert engine.scheduler.running[0].request_id == first


class _Handoff:
    """A handoff still reading the request's pages until ``done`` is set (a prefill node's)."""

    def __init__(self) -> None:
        self.done = False

    def on_layer(self, layer: int, pages: list[int], end: int) -> None:
        pass

    def busy(self) -> bool:
        return not self.done


def test_a_prompt_whose_handoff_still_reads_it_is_hit_meanwhile(tiny_llama: Path) -> None:
    """Prefill role: the request ends after its prompt, its pages parked while the handoff reads
    them; they are in the tree already, so the same prompt hits them, and every page returns once
    the handoff ends."""
    prompt = _tokens(PREFIX + 3, 9)
    engine = _engine(tiny_llama)
    handoff = _Handoff()
    engine.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0), handoff=handoff)
    engine.step()
    assert engine.scheduler.parked, "a's pages are parked while its handoff is busy"
    engine.add_request("b", prompt, SamplingParams(max_tokens=1, temperature=0))
    (out,) = engine.step()  # b: admitted, computes its last tokens only, done
    assert out.finished and out.cached_tokens == (len(prompt) - 1) // PAGE * PAGE
    handoff.done = True
    engine.step()
    assert not engine.scheduler.parked and engine.stats()["kv_pages_used"] == 0


def test_a_started_reservations_prompt_is_hit_by_the_next_step(tiny_llama: Path) -> None:
    """Decode role: a reservation whose prompt arrived starts (``start_reserved``); its full prompt
    pages are in the tree at once, so the same prompt added right after (a sibling choice the
    router forks here, docs/pd.md) hits them in the very next step and computes at most a page.
    Before, they joined only at release (or a HiCache node's checkpoint after that step)."""
    prompt = _tokens(PREFIX + 3, 11)
    engine = _engine(tiny_llama)
    engine.reserve("a", prompt, 4)
    engine.start_reserved("a", 5, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.add_request("b", prompt, SamplingParams(max_tokens=1, temperature=0))
    before = engine.prefill_tokens_computed
    outs = {o.request_id: o for o in engine.step()}
    full = (len(prompt) - 1) // PAGE * PAGE
    assert outs["b"].cached_tokens == full
    assert engine.prefill_tokens_computed - before == len(prompt) - full <= PAGE
    while engine.has_work():
        engine.step()
    assert engine.stats()["kv_pages_used"] == 0
