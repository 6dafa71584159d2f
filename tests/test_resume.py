"""The request a migration continues with (``router/migration.py`` ``resumed``): no processes."""

from __future__ import annotations

from dataclasses import dataclass

from tierserve.proto import tierserve_pb2 as pb
from tierserve.router.migration import resumed


@dataclass(frozen=True)
class _Request:
    id: str
    prompt: list[int]
    sampling: pb.SamplingOptions
    resumed: int = 0


def test_the_produced_tokens_join_the_prompt_and_leave_the_budgets() -> None:
    sampling = pb.SamplingOptions(max_tokens=10, min_tokens=4, temperature=0.8, seed=7, logprobs=2,
                                  prompt_logprobs=1)
    first = _Request("r", [5, 6], sampling)
    second = resumed(first, [7, 8, 9], 1)
    assert (second.id, second.prompt, second.resumed) == ("r-m1", [5, 6, 7, 8, 9], 3)
    assert (second.sampling.max_tokens, second.sampling.min_tokens) == (7, 1)
    assert second.sampling.seed == 7 and second.sampling.logprobs == 2 and second.sampling.temperature > 0.79
    assert not second.sampling.HasField("prompt_logprobs")  # sent with the first try's first output
    third = resumed(first, [7, 8, 9, 10, 11, 12], 2)  # from the original request, every token so far
    assert (third.id, third.prompt[-1], third.resumed, third.sampling.max_tokens, third.sampling.min_tokens) == (
        "r-m2", 12, 6, 4, 0)
    assert first.sampling.max_tokens == 10 and first.sampling.HasField("prompt_logprobs")  # untouched
