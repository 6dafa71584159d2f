"""Sampling settings between ``SamplingParams`` and their protobuf message (torch-free)."""

from __future__ import annotations

from tierserve.core.sampling import SamplingParams
from tierserve.proto import tierserve_pb2 as pb


def from_proto(options: pb.SamplingOptions) -> SamplingParams:
    """Proto defaults (0) mean "off" for top_p and top_k; raises ``InvalidRequestError``."""
    return SamplingParams(
        max_tokens=options.max_tokens or 16, temperature=options.temperature, top_p=options.top_p or 1.0,
        top_k=options.top_k, seed=options.seed if options.HasField("seed") else None, stop=list(options.stop),
        stop_token_ids=list(options.stop_token_ids), ignore_eos=options.ignore_eos,
        skip_special_tokens=options.skip_special_tokens,
    )


def to_proto(params: SamplingParams) -> pb.SamplingOptions:
    return pb.SamplingOptions(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=params.seed, stop=params.stop, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
    )
