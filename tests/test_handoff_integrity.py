"""``--handoff-integrity``: the prefill node digests the KV it hands over, per layer, and the decode
node checks what landed before decoding (``transfer/digest.py``). Unit tests of the digest, then
real nodes whose handoffs write wrong bytes for real (``corrupt_rate`` in the tests' fault file): every
corrupted handoff is a failed request (DATA_LOSS, counted, pages freed), never a wrong token."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from helpers import metrics
from helpers.injected_faults import handoff_env
from helpers.pd_nodes import DECODE_ARGS, NODE_ARGS, greedy, idle, prompts, reference, release, reserve, run_pd
from helpers.polling import wait_for
from helpers.processes import NodeProcess, free_port
from helpers.tiny_models import make_tiny_model

from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.transfer.digest import MASK, DigestWeights, layer_digest, slots_of, token_sums

HEADS, DIM = 4, 16


def _digest(kv: torch.Tensor, slots: list[int], positions: list[int], heads: tuple[int, int, int]) -> int:
    weights = DigestWeights(HEADS, DIM * 4, torch.device("cpu"))
    return layer_digest(kv, weights, 3, slots, positions, heads).item() & MASK


def test_the_digest_adds_up_over_any_split_and_changes_with_any_fault() -> None:
    kv = torch.randn(2, 64, HEADS, DIM)  # one layer: [K/V, slots, heads, dim]
    slots, positions = slots_of([2, None, 0, 3], 0, 60, 16)  # page 1 another rank's: left out
    assert len(slots) == 44 and positions[16] == 32 and slots[16] == 0
    whole = _digest(kv, slots, positions, (0, HEADS, 0))
    # Heads in two senders' parts (a rank holding heads 1..3 only), tokens in two chunks: the same sum.
    parts = (_digest(kv, slots[:20], positions[:20], (0, 1, 0)) + _digest(kv, slots[20:], positions[20:], (0, 1, 0))
             + _digest(kv[:, :, 1:], slots, positions, (0, 3, 1)))
    assert parts & MASK == whole
    run, at = slots[16:32], positions[16:32]  # one run of slots: read as a view, not gathered
    assert _digest(kv, run, at, (0, HEADS, 0)) == _digest(kv, run[::-1].copy(), at[::-1].copy(), (0, HEADS, 0))
    flipped = kv.clone()
    flipped.view(torch.int32)[1, slots[7], 2, 5] ^= 1 << 31  # one bit of one word of V
    swapped_kv = kv.flip(0)
    moved = kv.clone()
    moved[:, [slots[3], slots[4]]] = kv[:, [slots[4], slots[3]]]  # two tokens trade places
    for bad in (flipped, swapped_kv, moved):
        assert _digest(bad, slots, positions, (0, HEADS, 0)) != whole
    assert _digest(kv, slots, positions, (0, HEADS - 1, 1)) != _digest(kv, slots, positions, (0, HEADS - 1, 0))
    other_layer = layer_digest(kv, DigestWeights(HEADS, DIM * 4, torch.device("cpu")), 4, slots, positions,
                               (0, HEADS, 0)).item() & MASK
    assert other_layer != whole


def test_the_cuda_formula_equals_the_cpu_one_mod_2_32() -> None:
    """CUDA has no integer matmul: its product-and-sum must agree with the CPU's int32 matvec."""
    x = torch.randint(-2**31, 2**31 - 1, (2, 40, 24), dtype=torch.int32)
    a = torch.randint(-2**31, 2**31 - 1, (2, 24), dtype=torch.int32) | 1
    cuda_way = (x * a.unsqueeze(1)).sum(dim=(0, 2), dtype=torch.int64)
    assert ((token_sums(x, a) - cuda_way) & MASK).eq(0).all()


@pytest.fixture(scope="module")
def decode(long_llama: Path, tmp_path_factory) -> Iterator[NodeProcess]:
    folder, metrics = tmp_path_factory.mktemp("d"), free_port()
    node = NodeProcess("decode", ["--model", str(long_llama), *DECODE_ARGS, "--metrics-port", str(metrics)],
                       folder / "d.log")
    node.metrics_port = metrics  # type: ignore[attr-defined]
    try:
        yield node.wait_ready()
    finally:
        node.stop()


def _failures(node: NodeProcess) -> float:
    text = metrics.scrape(f"http://127.0.0.1:{node.metrics_port}")  # type: ignore[attr-defined]
    return metrics.value(text, "tierserve_handoff_integrity_failures_total")


async def _generate_without_digests(decode: str) -> grpc.StatusCode:
    """A decode node with ``--handoff-integrity`` refuses a Generate that carries no digests."""
    await reserve(decode, "bare", list(range(2, 40)))
    try:
        async with grpc.aio.insecure_channel(decode) as channel:
            call = pb_grpc.DecodeServiceStub(channel).Generate(pb.GenerateRequest(
                reservation_id="bare", first_token=3, sampling=greedy()))
            async for _ in call:
                return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        assert await release(decode, "bare", writer_stopped=True)
    return grpc.StatusCode.OK


async def _outcomes(prefill: str, decode: str, batch: list[list[int]], tag: str) -> list:
    async def one(i: int, prompt: list[int]) -> list[int] | BaseException:
        try:
            return (await run_pd(prefill, decode, f"{tag}{i}", prompt))[0]
        except grpc.aio.AioRpcError as exc:
            return exc

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))


@pytest.mark.integration
@pytest.mark.slow
def test_corrupted_handoffs_fail_with_data_loss_never_a_wrong_token(long_llama: Path, decode: NodeProcess,
                                                                    tmp_path: Path) -> None:
    """Every fourth handoff writes one layer's K where its V goes and back. Without digests that
    is a wrong answer; with them each is a counted DATA_LOSS whose pages come back, and every
    other request answers as the reference does."""
    plain = NodeProcess("prefill", ["--model", str(long_llama), *NODE_ARGS], tmp_path / "plain.log",
                        handoff_env(tmp_path / "plain.json", corrupt_rate=1.0))
    checked = NodeProcess("prefill", ["--model", str(long_llama), *NODE_ARGS, "--handoff-integrity"],
                          tmp_path / "checked.log", handoff_env(tmp_path / "checked.json", corrupt_rate=0.25))
    batch = [p + [7] * 40 for p in prompts(12, seed=11)]  # at least two pages each: both K and V runs
    expected = reference(long_llama, batch)
    try:
        plain.wait_ready(), checked.wait_ready()
        unchecked = asyncio.run(_outcomes(plain.address, decode.address, batch[:4], "plain"))
        assert any(got != want for got, want in zip(unchecked, expected[:4], strict=True)), "the fault is real"
        results = asyncio.run(_outcomes(checked.address, decode.address, batch[4:], "checked"))
        failed = [r for r in results if isinstance(r, BaseException)]
        assert len(failed) == 2 and all(r.code() is grpc.StatusCode.DATA_LOSS for r in failed), results
        assert all("does not match its digest" in r.details() for r in failed)
        assert _failures(decode) == 2
        for got, want in zip(results, expected[4:], strict=True):
            assert isinstance(got, BaseException) or got == want  # 0 wrong tokens
        wait_for(lambda: idle(checked.address, decode.address), "every page back on both nodes", 20)
    finally:
        plain.stop()
        checked.stop()


@pytest.mark.integration
@pytest.mark.slow
def test_digests_add_up_across_ranks_on_both_sides(tmp_path: Path) -> None:
    """A prefill node of two ranks (the ranks' digests added up in their agreement) hands over to
    decode nodes of one rank (through receive staging) and of two (their parts added up by a
    collective); every second handoff is corrupted on both prefill ranks: those fail, the others
    answer as the reference does (no false alarm)."""
    model = make_tiny_model("llama", tmp_path / "llama", heads=8, kv_heads=4, max_position=2048)
    on = ["--model", str(model), "--handoff-integrity"]
    prefill = NodeProcess("prefill", [*on, *NODE_ARGS, "--tp-size", "2"], tmp_path / "p.log",
                          handoff_env(tmp_path / "faults.json", corrupt_rate=0.5))
    decodes = [NodeProcess("decode", [*on, *DECODE_ARGS, "--tp-size", str(tp)], tmp_path / f"d{tp}.log")
               for tp in (1, 2)]
    batch = [p + [9] * 40 for p in prompts(4, seed=5)]
    try:
        prefill.wait_ready(), [d.wait_ready() for d in decodes]
        outcomes = [asyncio.run(_outcomes(prefill.address, decodes[i // 2].address, [prompt], f"r{i}-"))[0]
                    for i, prompt in enumerate(batch)]  # one at a time: handoffs 1 and 3 are corrupted
        expected = reference(model, batch)
        assert outcomes[0] == expected[0] and outcomes[2] == expected[2]
        codes = [isinstance(o, grpc.aio.AioRpcError) and o.code() for o in outcomes[1::2]]
        assert codes == [grpc.StatusCode.DATA_LOSS] * 2, outcomes
        assert asyncio.run(_generate_without_digests(decodes[0].address)) is grpc.StatusCode.FAILED_PRECONDITION
    finally:
        prefill.stop()
        for d in decodes:
            d.stop()


@pytest.mark.integration
@pytest.mark.slow
def test_through_the_router_a_corrupted_handoff_is_retried_and_answers_right(long_llama: Path, decode: NodeProcess,
                                                                              tmp_path: Path) -> None:
    """Every second handoff is corrupted: the router retries each refused one on a new try (the
    decode node not marked failed), so every request answers the reference's tokens."""
    from helpers.logprob_checks import ids_of
    from helpers.processes import RouterProcess

    prefill = NodeProcess("prefill", ["--model", str(long_llama), *NODE_ARGS, "--handoff-integrity"],
                          tmp_path / "p.log", handoff_env(tmp_path / "faults.json", corrupt_rate=0.5))
    batch = [p + [5] * 40 for p in prompts(4, seed=23)]
    expected = reference(long_llama, batch)
    try:
        prefill.wait_ready()
        router = RouterProcess(["--model", str(long_llama), "--prefill", prefill.address, "--decode", decode.address],
                               tmp_path / "r.log").wait_ready()
        before = _failures(decode)
        try:
            for prompt, want in zip(batch, expected, strict=True):
                body = {"prompt": prompt, "max_tokens": len(want), "temperature": 0, "ignore_eos": True,
                        "logprobs": 0, "return_tokens_as_token_ids": True}
                r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                assert ids_of(r.json()["choices"][0]["logprobs"]["tokens"]) == want
            assert _failures(decode) - before == 3  # handoffs 1, 3 and 5 of 7
            assert httpx.get(f"{router.url}/debug/state", timeout=10).json()["retries"] == 3
        finally:
            router.stop()
    finally:
        prefill.stop()
