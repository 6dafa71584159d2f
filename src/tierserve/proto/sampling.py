"""Sampling settings and token logprobs between their core types and protobuf messages (torch-free)."""

from __future__ import annotations

from tierserve.core.constraint import Constraint, ConstraintKind
from tierserve.core.outputs import TokenLogprob
from tierserve.core.sampling import InvalidRequestError, SamplingParams
from tierserve.proto import tierserve_pb2 as pb


def from_proto(options: pb.SamplingOptions) -> SamplingParams:
    """Proto defaults (0) mean "off" for top_p and top_k; raises ``InvalidRequestError``."""
    return SamplingParams(
        max_tokens=options.max_tokens or 16, temperature=options.temperature, top_p=options.top_p or 1.0,
        top_k=options.top_k, seed=options.seed if options.HasField("seed") else None, stop=list(options.stop),
        stop_token_ids=list(options.stop_token_ids), ignore_eos=options.ignore_eos,
        skip_special_tokens=options.skip_special_tokens, min_tokens=options.min_tokens,
        logprobs=options.logprobs if options.HasField("logprobs") else None,
        prompt_logprobs=options.prompt_logprobs if options.HasField("prompt_logprobs") else None,
        prompt_logprobs_start=options.prompt_logprobs_start,
        constraint=constraint_from_proto(options.constraint) if options.HasField("constraint") else None,
        priority=options.priority, deadline_ms=options.deadline_ms if options.HasField("deadline_ms") else None,
    )


def to_proto(params: SamplingParams) -> pb.SamplingOptions:
    return pb.SamplingOptions(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=params.seed, stop=params.stop, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens, min_tokens=params.min_tokens, logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs, prompt_logprobs_start=params.prompt_logprobs_start,
        constraint=constraint_to_proto(params.constraint) if params.constraint is not None else None,
        priority=params.priority, deadline_ms=params.deadline_ms,
    )


_KINDS = {kind: pb.ConstraintKind.Value(f"CONSTRAINT_KIND_{kind.name}") for kind in ConstraintKind}


def constraint_to_proto(c: Constraint) -> pb.Constraint:
    return pb.Constraint(kind=_KINDS[c.kind], spec=c.spec, strict=c.strict, resumed=c.resumed)


def constraint_from_proto(msg: pb.Constraint) -> Constraint:
    """Raises ``InvalidRequestError`` for a kind this side does not know."""
    kind = next((k for k, v in _KINDS.items() if v == msg.kind), None)
    if kind is None:
        raise InvalidRequestError(f"unknown structured-output kind {msg.kind}")
    return Constraint(kind, msg.spec, msg.strict, msg.resumed)


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                           top_logprobs=[v for _, v in lp.top])


def logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprob:
    """Values were float32 on the engine, so the proto's float32 carries them exactly."""
    return TokenLogprob(msg.token_id, msg.logprob, tuple(zip(msg.top_ids, msg.top_logprobs, strict=True)))
