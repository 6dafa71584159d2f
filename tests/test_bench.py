"""Unit tests of tierserve.bench's generators: determinism, token ranges, multi-turn history, the
trace adapters' sharing structure, and Poisson arrivals."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tierserve.bench.records import RequestRecord
from tierserve.bench.runner import BenchOptions, arrivals
from tierserve.bench.tokens import TokenSpace
from tierserve.bench.traces import BlockBank, TraceConfig, azure_trace, mooncake_prompt, mooncake_trace
from tierserve.bench.workloads import MultiTurnConfig, SharedPrefixConfig, multiturn, shared_prefix

TRACES = Path(__file__).resolve().parent / "data" / "traces"  # samples of the public traces: see its README.md
MOONCAKE = TRACES / "mooncake_conversation_first_200.jsonl"  # the 200 records the adapter test reads
AZURE = TRACES / "azure_llm_2023_conv_first_30.csv"
SPACE = TokenSpace(vocab_size=384, min_id=32)


def answered(n_tokens: int, text: str = " an answer") -> RequestRecord:
    return RequestRecord(index=0, tags={}, scheduled_at=0, ok=True, output_tokens=n_tokens, text=text)


def play(workload, rounds_answer: int = 8) -> list:
    """Every request each session sends when every answer has ``rounds_answer`` tokens."""
    out = []
    for session in workload.sessions:
        spec = session.first()
        while spec is not None:
            out.append(spec)
            spec = session.next(answered(rounds_answer))
    return out


@pytest.mark.parametrize("style", ["tokens", "text", "chat"])
def test_multiturn_is_deterministic_given_a_seed(style: str) -> None:
    config = MultiTurnConfig(clients=3, rounds=3, context_length=20, question_length=5, output_length=4)
    a, b = play(multiturn(config, style, SPACE, seed=1)), play(multiturn(config, style, SPACE, seed=1))
    c = play(multiturn(config, style, SPACE, seed=2))
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert [s.tags for s in a] == [s.tags for s in b]
    assert [s.prompt for s in a] != [s.prompt for s in c]
    assert len(a) == 9


def test_multiturn_history_carries_every_previous_prompt_and_answer() -> None:
    config = MultiTurnConfig(clients=2, rounds=4, context_length=30, question_length=7, output_length=5)
    for session in multiturn(config, "tokens", SPACE, seed=0).sessions:
        spec, lengths = session.first(), []
        while spec is not None:
            assert all(SPACE.min_id <= t < SPACE.vocab_size for t in spec.prompt)
            lengths.append(len(spec.prompt))
            previous = spec.prompt
            spec = session.next(answered(5))
            if spec is not None:
                assert spec.prompt[:len(previous)] == previous
        assert lengths == [37, 49, 61, 73]  # + the 5-token answer and a 7-token question each round


def test_multiturn_text_and_chat_history_include_the_answer_text() -> None:
    config = MultiTurnConfig(clients=1, rounds=2, context_length=10, question_length=3)
    text = multiturn(config, "text", SPACE, seed=0).sessions[0]
    first = text.first().prompt
    assert text.next(answered(3, " ANSWER")).prompt.startswith(first + " ANSWER ")
    chat = multiturn(config, "chat", SPACE, seed=0).sessions[0]
    messages = chat.first().prompt
    assert [m["role"] for m in messages] == ["system", "user"]
    follow = chat.next(answered(3, "ANSWER")).prompt
    assert follow[:2] == messages and follow[2] == {"role": "assistant", "content": "ANSWER"}
    assert follow[3]["role"] == "user"


def test_shared_prefix_groups_share_exactly_their_system_prompt() -> None:
    config = SharedPrefixConfig(groups=3, prompts_per_group=4, system_length=40, question_length=6)
    workload = shared_prefix(config, "tokens", SPACE, seed=3)
    specs = [s.first() for s in workload.sessions]
    assert [s.prompt for s in specs] == [s.first().prompt for s in shared_prefix(config, "tokens", SPACE, 3).sessions]
    assert len(specs) == 12 and all(len(s.prompt) == 46 for s in specs)
    by_group: dict[int, list[list[int]]] = {}
    for s in specs:
        by_group.setdefault(s.tags["group"], []).append(s.prompt)
    systems = {g: {tuple(p[:40]) for p in ps} for g, ps in by_group.items()}
    assert all(len(v) == 1 for v in systems.values()) and len({next(iter(v)) for v in systems.values()}) == 3
    assert [s.tags["group"] for s in specs] != sorted(s.tags["group"] for s in specs)  # spread, not grouped


def common_blocks(a: list[int], b: list[int], size: int) -> int:
    n = 0
    while a[n * size:(n + 1) * size] == b[n * size:(n + 1) * size] and len(a) >= (n + 1) * size:
        n += 1
    return n


def shared_ids(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def test_trace_blocks_preserve_the_sharing_structure() -> None:
    bank = BlockBank(SPACE, block_size=8, seed=0)
    records = [{"input_length": 512 * 4, "hash_ids": [1, 2, 3, 4]},
               {"input_length": 512 * 4, "hash_ids": [1, 2, 9, 10]},
               {"input_length": 512 * 3, "hash_ids": [1, 2, 3]},
               {"input_length": 512 * 3, "hash_ids": [1 + SPACE.span, 2, 3]},  # same first token as id 1
               {"input_length": 512 * 2 + 100, "hash_ids": [7, 8, 5]}]
    prompts = [mooncake_prompt(r, bank) for r in records]
    assert [len(p) for p in prompts] == [32, 32, 24, 24, 18]  # 100 of 512 -> ceil(100 * 8 / 512) = 2
    for i, a in enumerate(records):
        for j, b in enumerate(records[:i]):
            k = shared_ids(a["hash_ids"], b["hash_ids"])
            assert common_blocks(prompts[i], prompts[j], 8) == k, (i, j)


def test_trace_adapter_on_the_real_trace_shares_exactly_k_blocks() -> None:
    config = TraceConfig(MOONCAKE, block_size=16, max_records=200)
    workload = mooncake_trace(config, TokenSpace(), seed=0)
    again = mooncake_trace(config, TokenSpace(), seed=0)
    records = [json.loads(line) for line, _ in zip(MOONCAKE.open(), range(200), strict=False)]
    prompts = [s.first().prompt for s in workload.sessions]
    assert prompts == [s.first().prompt for s in again.sessions]
    rng = random.Random(0)
    pairs = [(rng.randrange(200), rng.randrange(200)) for _ in range(400)]
    pairs += [(i, i + 1) for i in range(199)]  # neighbours: the trace's conversations share most here
    for i, j in pairs:
        k = shared_ids(records[i]["hash_ids"], records[j]["hash_ids"])
        full = min(len(prompts[i]), len(prompts[j])) // 16
        assert common_blocks(prompts[i], prompts[j], 16) == min(k, full), (i, j, k)
    assert any(shared_ids(records[i]["hash_ids"], records[j]["hash_ids"]) > 1 for i, j in pairs)
    for spec, rec in zip((s.first() for s in workload.sessions), records, strict=True):
        assert abs(len(spec.prompt) - rec["input_length"] / 32) <= 16
        assert spec.max_tokens == max(1, round(rec["output_length"] / 32))
        assert all(32 <= t < 49152 for t in spec.prompt)
    times = [s.arrival for s in workload.sessions]
    assert times[0] == 0 and times == sorted(times)
    assert times[-1] == (records[-1]["timestamp"] - records[0]["timestamp"]) / 1000


def test_trace_prompts_are_cut_to_the_context() -> None:
    config = TraceConfig(MOONCAKE, block_size=16, max_records=50, max_prompt_tokens=100, output_scale=0.01)
    specs = [s.first() for s in mooncake_trace(config, SPACE).sessions]
    assert max(len(s.prompt) for s in specs) == 100 and min(s.max_tokens for s in specs) >= 1


def test_azure_trace_has_lengths_and_arrivals_but_no_reuse() -> None:
    config = TraceConfig(AZURE, block_size=32, max_records=30)
    workload = azure_trace(config, SPACE, seed=0)
    specs = [s.first() for s in workload.sessions]
    assert len(specs) == 30 and len(specs[0].prompt) == round(374 / 16) and specs[0].max_tokens == round(44 / 16)
    assert workload.sessions[1].arrival == pytest.approx(50.9951690 - 46.6805900, abs=1e-5)
    assert len({tuple(s.prompt[:4]) for s in specs}) == 30
    assert [s.prompt for s in specs] == [s.first().prompt for s in azure_trace(config, SPACE, seed=0).sessions]


def test_arrivals_per_mode() -> None:
    workload = shared_prefix(SharedPrefixConfig(groups=10, prompts_per_group=100), "tokens", SPACE)
    assert arrivals(workload, BenchOptions(mode="closed")) == [0.0] * 1000
    poisson = arrivals(workload, BenchOptions(mode="poisson", rate=50.0, seed=4))
    assert poisson == arrivals(workload, BenchOptions(mode="poisson", rate=50.0, seed=4))
    assert poisson != arrivals(workload, BenchOptions(mode="poisson", rate=50.0, seed=5))
    assert poisson == sorted(poisson) and poisson[-1] / 999 == pytest.approx(1 / 50, rel=0.15)
    trace = mooncake_trace(TraceConfig(MOONCAKE, max_records=30), SPACE)
    scaled = arrivals(trace, BenchOptions(mode="trace", time_scale=0.1))
    assert scaled == pytest.approx([s.arrival * 0.1 for s in trace.sessions])
    with pytest.raises(ValueError):
        BenchOptions(mode="poisson", rate=0)


def test_token_space_excludes_special_ids_and_tags_blocks() -> None:
    rng = random.Random(0)
    ids = TokenSpace(384, 32).random_ids(rng, 5000)
    assert min(ids) >= 32 and max(ids) < 384
    space = TokenSpace(40, 30)
    heads = {tuple(space.tagged_ids(tag, rng, 4)[:2]) for tag in range(100)}
    assert len(heads) == 100
    with pytest.raises(ValueError):
        space.tagged_ids(100, rng, 4)


def test_the_bench_package_is_a_client_without_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, tierserve.bench.runner, tierserve.cli.bench, tierserve.bench.traces, "
            "tierserve.bench.compare, tierserve.bench.plots; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_cli_builds_each_workload_from_flags() -> None:
    from tierserve.cli.bench import bench_options, build_workload
    from tierserve.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "run", "multiturn", "--conversations", "3", "--rounds", "2", "--barrier"])
    assert build_workload(args).planned == 6 and bench_options(args).barrier
    args = parser.parse_args(["bench", "run", "shared-prefix", "--groups", "2", "--prompts-per-group", "3"])
    assert build_workload(args).planned == 6 and bench_options(args).mode == "closed"
    args = parser.parse_args(["bench", "run", "trace", "--trace", str(MOONCAKE), "--max-records", "5"])
    assert build_workload(args).planned == 5 and bench_options(args).mode == "trace"
    args = parser.parse_args(["bench", "run", "azure", "--trace", str(AZURE), "--max-records", "5",
                              "--mode", "poisson"])
    assert build_workload(args).name == "azure" and bench_options(args).mode == "poisson"
    with pytest.raises(ValueError):
        build_workload(parser.parse_args(["bench", "run", "trace"]))
