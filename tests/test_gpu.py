"""The same engine code on CUDA (run where a GPU exists: pytest -m gpu)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tierserve.cache.options import HiCacheOptions, IOBackend
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_greedy_matches_cpu_and_host_tier_round_trips(tiny_llama: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 384, (n,), generator=gen).tolist() for n in (9, 33, 70)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    cpu = Engine(EngineConfig(tiny_llama, device="cpu", dtype="float32", page_size=16, max_total_tokens=2048))
    cuda = Engine(EngineConfig(tiny_llama, device="cuda", dtype="float32", page_size=16, max_total_tokens=2048,
                               chunked_prefill_size=16, enable_hierarchical_cache=True,
                               hicache=HiCacheOptions(ratio=2.0)))
    assert cuda.pool.buffer.is_cuda and cuda.cache.host.buffer.is_pinned()
    expected = cpu.generate(prompts, params)
    assert cuda.generate(prompts, params) == expected
    assert cuda.generate(prompts, params) == expected  # now with device hits
    assert cuda.stats()["kv_pages_used"] == 0


def _cuda_engine(model: Path, tmp_path: Path | None = None, **hicache) -> Engine:
    """CUDA engine whose 96-token L1 the fillers push a prompt out of (to L2, and to L3 when given)."""
    storage = {"storage_backend": "file", "storage_config": {"path": str(tmp_path), "prefetch_threshold": 16}} \
        if tmp_path is not None else {}
    return Engine(EngineConfig(model, device="cuda", dtype="float32", page_size=4, max_total_tokens=96,
                               enable_hierarchical_cache=True,
                               hicache=HiCacheOptions(ratio=4.0, **storage, **hicache)))


def _target_and_fillers() -> tuple[list[int], list[list[int]]]:
    gen = torch.Generator().manual_seed(11)
    return torch.randint(2, 384, (64,), generator=gen).tolist(), \
        [torch.randint(2, 384, (60,), generator=gen).tolist() for _ in range(3)]


PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _expected(model: Path, prompt: list[int]) -> list[int]:
    plain = Engine(EngineConfig(model, device="cpu", dtype="float32", page_size=4, max_total_tokens=512,
                                disable_radix_cache=True))
    return plain.generate([prompt], PARAMS)[0]


def test_cuda_l2_round_trips_give_the_cpu_output(tiny_llama: Path) -> None:
    """L1 -> L2 copies (non_blocking D2H) and L2 -> L1 loads (H2D, layer by layer) on CUDA: the
    host hit is read only after its copy completed, and the output equals the CPU's."""
    from helpers.engine_runs import run_one

    target, fillers = _target_and_fillers()
    for backend in IOBackend:
        engine = _cuda_engine(tiny_llama, io_backend=backend)
        run_one(engine, target, PARAMS)
        for filler in fillers:
            engine.cache.wait_background()
            run_one(engine, filler, PARAMS)
        engine.cache.wait_background()
        tokens, tiers = run_one(engine, target, PARAMS)
        assert tokens == _expected(tiny_llama, target) and tiers.get("host", 0) >= 32, (backend, tiers)
        engine.cache.close()


def test_cuda_l3_round_trip_gives_the_cpu_output(tiny_llama: Path, tmp_path: Path) -> None:
    """Pages copied to L2 and backed up to L3 on CUDA (the backup reads host pages only after the
    D2H copy landed) come back to another CUDA engine from storage."""
    from helpers.engine_runs import run_one

    from tierserve.cache.options import PrefetchPolicy

    target, _ = _target_and_fillers()
    first = _cuda_engine(tiny_llama, tmp_path)
    run_one(first, target, PARAMS)
    first.cache.wait_background()
    second = _cuda_engine(tiny_llama, tmp_path, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    tokens, tiers = run_one(second, target, PARAMS)
    assert tokens == _expected(tiny_llama, target) and tiers.get("storage", 0) >= 32, tiers
    first.cache.close()
    second.cache.close()


def test_cuda_pd_handoff_equals_the_single_engine(long_llama: Path, tmp_path: Path) -> None:
    """A prefill and a decode node on the GPU: the per-layer handoff waits for each layer's store
    kernels before the transfer engine reads the pages."""
    import asyncio

    from helpers.pd_nodes import CHUNK, MAX_NEW, PAGE, prompts, run_pd
    from helpers.processes import NodeProcess

    args = ["--model", str(long_llama), "--device", "cuda", "--dtype", "float32", "--page-size", str(PAGE),
            "--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "4096"]
    nodes = [NodeProcess("prefill", args, tmp_path / "p.log"), NodeProcess("decode", args, tmp_path / "d.log")]
    try:
        prefill, decode = (n.wait_ready() for n in nodes)
        batch = prompts(4, seed=3)
        got = [asyncio.run(run_pd(prefill.address, decode.address, f"gpu-{i}", p))[0] for i, p in enumerate(batch)]
        cpu = Engine(EngineConfig(long_llama, device="cpu", dtype="float32", page_size=PAGE, chunked_prefill_size=CHUNK,
                                  max_total_tokens=4096))
        assert got == cpu.generate(batch, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.parametrize(("p", "d"), [(("cuda", 1), ("cpu", 2)), (("cpu", 2), ("cuda", 1))])
def test_cuda_handoff_between_tp_sizes_through_staging(p: tuple[str, int], d: tuple[str, int], tmp_path: Path
                                                       ) -> None:
    """One GPU, so the TP=2 side runs on the CPU (gloo): a CUDA prefill rank gathers its heads for
    two decode ranks in GPU staging, or two CPU prefill ranks write into a CUDA decode rank's
    staging, scattered into its pages on the GPU. Answers equal the single engine's."""
    from helpers.pd_nodes import CHUNK, PAGE, reference, run_pair
    from helpers.tiny_models import make_tiny_model

    model = make_tiny_model("llama", tmp_path / "llama", heads=8, kv_heads=4, max_position=2048)
    args = ["--model", str(model), "--dtype", "float32", "--page-size", str(PAGE), "--chunked-prefill-size",
            str(CHUNK), "--max-total-tokens", "4096"]
    (p_device, p_tp), (d_device, d_tp) = p, d
    batch, got = run_pair([*args, "--device", p_device, "--tp-size", str(p_tp)],
                          [*args, "--device", d_device, "--tp-size", str(d_tp)],
                          (tmp_path / "prefill.log", tmp_path / "decode.log"), 7, "gpu-mixed-")
    assert [tokens for tokens, _ in got] == reference(model, batch)
    assert [r.transferred_bytes for _, r in got] == [len(q) * 2 * 2 * 4 * 16 * 4 for q in batch]


def test_cuda_structured_outputs_match_cpu(tmp_path: Path) -> None:
    """The grammar's bitmask applied on the device: constrained greedy outputs equal the CPU's, and
    each is the schema's JSON (a byte tokenizer: the GPU machine has no built-in model)."""
    import json

    from helpers.tiny_models import add_byte_tokenizer, make_tiny_model
    from tokenizers import Tokenizer

    from tierserve.core.constraint import Constraint, ConstraintKind

    model = add_byte_tokenizer(make_tiny_model("qwen3", tmp_path / "qwen3"))
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 999}}, "required": ["a"],
              "additionalProperties": False}
    params = SamplingParams(max_tokens=24, temperature=0,
                            constraint=Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)))
    prompts = [[5, 6, 7], [100, 200, 300, 40]]
    engines = [Engine(EngineConfig(model, device=d, dtype="float32", page_size=16, max_total_tokens=2048))
               for d in ("cpu", "cuda")]
    cpu, cuda = (e.generate(prompts, params) for e in engines)
    assert cuda == cpu
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert all(set(json.loads(tokenizer.decode(out))) == {"a"} for out in cuda)


def test_a_cuda_rank_joins_nccl_with_the_node_fault_settings(tiny_llama: Path) -> None:
    """One CUDA rank joins its node's groups: NCCL for the model, a gloo control group, and the NCCL
    fault settings in its environment before the group formed (``nccl_settings``); once started, every
    group (NCCL's too) takes the step timeout (``Ranks.started``), and a collective runs."""
    import torch.distributed as dist

    from tierserve.engine.procs.ranks import RankSpec, join, nccl_settings, rendezvous

    store = rendezvous(1, 60.0)
    ranks = join(RankSpec(0, 1, store.port, 60.0), EngineConfig(tiny_llama, device="cuda"), store)
    try:
        assert dist.get_backend() == "nccl" and ranks.control is not None
        assert all(os.environ.get(k) is not None for k in nccl_settings(60.0))
        ranks.started()  # _set_pg_timeout on the NCCL group (run on a GPU: not yet, docs/faults.md)
        total = torch.ones(4, device=ranks.device)
        dist.all_reduce(total)
        assert total.tolist() == [1.0] * 4
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("algorithm", ["EAGLE", "NGRAM"])
def test_cuda_speculation_keeps_the_cpu_greedy_output(tmp_path: Path, algorithm: str) -> None:
    """Drafting and verifying on the device (the head's features, the lookup's tokens, the accepted
    rows' KV) leave greedy output equal to the CPU engine without speculation, with drafts accepted."""
    from helpers.engine_runs import assert_no_pages_held, spread_prompts
    from helpers.tiny_models import make_eagle_target, make_looping_model, make_mimic_eagle

    from tierserve.engine.config import SpeculativeAlgorithm

    target = make_eagle_target(tmp_path / "target")
    spec = {"speculative_algorithm": SpeculativeAlgorithm[algorithm], "speculative_num_steps": 3}
    if algorithm == "EAGLE":
        spec["speculative_draft_model_path"] = make_mimic_eagle(target, tmp_path / "head", 0.1)
    else:
        target = make_looping_model(target, tmp_path / "looping")
    prompts, params = spread_prompts(4, 12, seed=3), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    config = {"dtype": "float32", "page_size": 4, "max_total_tokens": 2048}
    want = Engine(EngineConfig(target, device="cpu", **config)).generate(prompts, params)
    cuda = Engine(EngineConfig(target, device="cuda", chunked_prefill_size=8, **config, **spec))
    assert cuda.generate(prompts, params) == want
    assert cuda.spec.counters.accepted_tokens > 0
    assert_no_pages_held(cuda)
