"""Continuous offload of generated KV (``EngineConfig.offload_generated``, cache/generated.py): a
running request's full pages reach L3 under its prompt's chain before it finishes, another engine
continues it from there with the same tokens, and nothing changes the output or leaks a page."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from helpers.engine_runs import run_one

from tierserve.cache import generated
from tierserve.cache.hashing import page_keys
from tierserve.cache.options import HiCacheOptions, PrefetchPolicy, WritePolicy
from tierserve.cache.storage.file import FileStorage
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

PAGE, PROMPT_LEN, MAX_NEW = 16, 40, 120
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
_ids = itertools.count()


def _prompt(seed: int = 4, n: int = PROMPT_LEN) -> list[int]:
    return torch.randint(2, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model: Path, l3: Path, offload: bool = True, tokens: int = 1024,
            policy: WritePolicy = WritePolicy.WRITE_THROUGH) -> Engine:
    opts = HiCacheOptions(ratio=4.0, storage_backend="file", write_policy=policy,
                          storage_config={"path": str(l3), "prefetch_threshold": 2 * PAGE},
                          prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    return Engine(EngineConfig(model, dtype="float32", page_size=PAGE, max_total_tokens=tokens,
                               enable_hierarchical_cache=True, hicache=opts, offload_generated=offload))


def _in_l3(engine: Engine, l3: Path, tokens: list[int]) -> int:
    """How many leading full pages of ``tokens`` the L3 directory holds."""
    keys = page_keys(engine.namespace.seed(), tokens[: len(tokens) // PAGE * PAGE], PAGE)
    return FileStorage(l3).batch_exists(keys)


def _idle_and_accounted(engine: Engine) -> None:
    engine.cache.wait_background()
    assert engine.stats()["kv_pages_used"] == 0
    assert engine.cache.host.allocator.num_used == len(engine.cache.tree.host_pages())


def _step_until(engine: Engine, rid: str, n: int) -> list[int]:
    """Steps until request ``rid`` has ``n`` output tokens; returns them."""
    tokens: list[int] = []
    while len(tokens) < n:
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.new_token_ids]
    return tokens


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> list[int]:
    plain = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=PAGE, max_total_tokens=1024,
                                disable_radix_cache=True))
    return plain.generate([_prompt()], GREEDY)[0]


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_generated_pages_reach_l3_while_running_and_another_engine_continues(tiny_llama: Path, tmp_path: Path,
                                                                            expected: list[int],
                                                                            policy: WritePolicy) -> None:
    """After 90 tokens (of 120) every full page of prompt + output that has KV is in L3 while the
    request still runs, whatever the write policy; a second engine (empty L1 and L2) given prompt +
    those tokens takes >= 90% of them from L3 and generates the rest of the uninterrupted run."""
    first = _engine(tiny_llama, tmp_path, policy=policy)
    first.add_request("long", _prompt(), GREEDY)
    so_far = _step_until(first, "long", 90)
    first.cache.wait_background()  # the copies in flight land (no new token meanwhile)
    history = _prompt() + so_far
    assert first.scheduler.running, "the request still runs"
    held = -(-(len(history) - 1) // PAGE)  # every page with KV; the checkpointed ones are pinned tree pages
    assert first.stats()["kv_pages_used"] >= held and first.stats()["kv_pages_cached"] == 0
    assert _in_l3(first, tmp_path, history[:-1]) == (len(history) - 1) // PAGE  # the last token has no KV yet
    stats = first.cache.stats()  # the prompt's pages joined as computed (in-flight sharing), the rest by checkpoints
    assert stats["offload_checkpoint_pages_total"] + stats["inflight_shared_pages_total"] >= (len(history) - 1) // PAGE
    assert stats["inflight_shared_pages_total"] == len(_prompt()) // PAGE
    second = _engine(tiny_llama, tmp_path)
    rest, tiers = run_one(second, history, SamplingParams(max_tokens=MAX_NEW - 90, temperature=0, ignore_eos=True))
    assert so_far + rest == expected
    assert tiers.get("storage", 0) >= 0.9 * len(history), tiers
    assert _step_until(first, "long", MAX_NEW - 90) == rest
    for engine in (first, second):
        _idle_and_accounted(engine)


def test_offload_changes_no_token_and_survives_preemption(tiny_llama: Path, tmp_path: Path) -> None:
    """Eight requests in a pool too small for all of them (preemptions recompute from checkpointed
    pages): the same tokens as without offload, every page back."""
    batch = [_prompt(seed) for seed in range(8)]
    plain = _engine(tiny_llama, tmp_path / "plain", offload=False, tokens=1024).generate(batch, GREEDY)
    engine = _engine(tiny_llama, tmp_path / "l3", tokens=640)
    assert engine.generate(batch, GREEDY) == plain
    assert engine.scheduler.num_preemptions > 0
    _idle_and_accounted(engine)


def test_a_full_copy_queue_defers_copies_instead_of_waiting(tiny_llama: Path, tmp_path: Path,
                                                           expected: list[int], monkeypatch) -> None:
    """With no room in the copy queue, checkpoints start no copy (counted as deferred): the pages
    join the tree and reach L3 once the request releases them; the tokens stay the same."""
    monkeypatch.setattr(generated, "QUEUE_CAP", 0)
    engine = _engine(tiny_llama, tmp_path)
    engine.add_request("r", _prompt(), GREEDY)
    so_far = _step_until(engine, "r", 60)
    engine.cache.wait_background()
    # the prompt's pages joined while computed (in-flight sharing), written through as a release would;
    # no generated page is copied
    assert _in_l3(engine, tmp_path, (_prompt() + so_far)[:-1]) == len(_prompt()) // PAGE
    assert engine.cache.stats()["offload_deferred_pages_total"] > 0
    assert engine.cache.stats()["offload_checkpoint_pages_total"] == 0
    assert so_far + _step_until(engine, "r", MAX_NEW - 60) == expected
    engine.cache.wait_background()
    sequence = _prompt() + expected
    assert _in_l3(engine, tmp_path, sequence[:-1]) == (len(sequence) - 1) // PAGE
    _idle_and_accounted(engine)
