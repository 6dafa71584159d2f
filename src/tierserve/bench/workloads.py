"""Synthetic workloads: multi-turn conversations and shared-prefix groups.

A workload is a list of sessions. A session yields its requests one at a time, each built from
the answer to the one before (``next``), so a conversation's round r+1 carries round r's answer in
its history. Everything is drawn from ``random.Random`` seeded by the workload seed and the
session's identity: the same seed gives the same prompts, whatever the run's timing.

Prompt styles: ``tokens`` (token ids to /v1/completions: exact lengths, any model, no tokenizer
needed), ``text`` (a string to /v1/completions) and ``chat`` (messages to /v1/chat/completions).
In ``tokens`` style the answer's token ids are not known to the client (servers stream text), so a
conversation's history takes deterministic stand-in tokens of the answer's length instead; use
``text`` or ``chat`` to measure reuse of the answer's own KV (e.g. the decode node's L3 offload)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tierserve.bench.records import Prompt, RequestRecord, RequestSpec
from tierserve.bench.tokens import TokenSpace, random_text

PromptStyle = Literal["tokens", "text", "chat"]
STYLES: tuple[PromptStyle, ...] = ("tokens", "text", "chat")


class Session(Protocol):
    """A sequence of requests. ``arrival`` (seconds from the start, or None) is when a trace says
    its first request comes; ``planned`` is how many requests it sends if none fails."""

    arrival: float | None
    planned: int

    def first(self) -> RequestSpec: ...

    def next(self, previous: RequestRecord) -> RequestSpec | None:
        """The request after ``previous`` (which succeeded), or None when the session is over."""
        ...


@dataclass
class Workload:
    """Sessions plus a description (``name`` and ``params`` go into the report)."""

    name: str
    params: dict[str, Any]
    sessions: list[Session]

    @property
    def planned(self) -> int:
        return sum(s.planned for s in self.sessions)


@dataclass
class OneShot:
    """A session of one request."""

    spec: RequestSpec
    arrival: float | None = None
    planned: int = 1

    def first(self) -> RequestSpec:
        return self.spec

    def next(self, previous: RequestRecord) -> RequestSpec | None:
        return None


@dataclass
class Content:
    """Draws prompt pieces of a given length in one style from one random stream."""

    style: PromptStyle
    space: TokenSpace
    rng: random.Random

    def piece(self, n: int) -> list[int] | str:
        return self.space.random_ids(self.rng, n) if self.style == "tokens" else random_text(self.rng, n)


@dataclass
class MultiTurnConfig:
    """``clients`` conversations of ``rounds`` rounds. Round 0 sends ``context_length`` tokens of
    context plus a question; every round sends the whole history plus a new question of
    ``question_length`` tokens and asks for ``output_length`` tokens (words in text styles)."""

    clients: int = 8
    rounds: int = 4
    context_length: int = 256
    question_length: int = 64
    output_length: int = 32


@dataclass
class Conversation:
    """One client's conversation; history grows by each question and each answer."""

    index: int
    config: MultiTurnConfig
    content: Content
    arrival: float | None = None
    round: int = 0
    history: Any = None
    last_prompt: Any = None

    @property
    def planned(self) -> int:
        return self.config.rounds

    def first(self) -> RequestSpec:
        context = self.content.piece(self.config.context_length)
        self.history = [] if self.content.style == "chat" else context
        if self.content.style == "chat" and context:
            self.history = [{"role": "system", "content": context}]
        return self._ask()

    def next(self, previous: RequestRecord) -> RequestSpec | None:
        if self.round + 1 >= self.config.rounds:
            return None
        self.history = self._with_answer(previous)
        self.round += 1
        return self._ask()

    def _ask(self) -> RequestSpec:
        question = self.content.piece(self.config.question_length)
        if self.content.style == "chat":
            prompt: Prompt = [*self.history, {"role": "user", "content": question}]
        elif self.content.style == "text":
            prompt = f"{self.history} {question}" if self.history else question
        else:
            prompt = self.history + question
        self.last_prompt = prompt
        return RequestSpec(prompt, self.config.output_length, {"session": self.index, "round": self.round})

    def _with_answer(self, previous: RequestRecord) -> Any:
        prompt = self.last_prompt
        if self.content.style == "chat":
            return [*prompt, {"role": "assistant", "content": previous.text}]
        if self.content.style == "text":
            return prompt + previous.text
        return prompt + self.content.piece(previous.output_tokens)  # stand-in for the answer's ids


def multiturn(config: MultiTurnConfig, style: PromptStyle = "tokens", space: TokenSpace | None = None,
              seed: int = 0) -> Workload:
    """The shape of SGLang's HiCache multi-turn benchmark: many clients, each resending its growing
    history, so a round's prefix is the previous round's whole prompt and answer."""
    space = space or TokenSpace()
    sessions: list[Session] = [
        Conversation(c, config, Content(style, space, random.Random(f"{seed}:multiturn:{c}")))
        for c in range(config.clients)]
    params = {**config.__dict__, "style": style, "vocab_size": space.vocab_size, "seed": seed}
    return Workload("multiturn", params, sessions)


@dataclass
class SharedPrefixConfig:
    """``groups`` x ``prompts_per_group`` prompts: a ``system_length`` system prompt shared by a
    group plus a ``question_length`` question of each prompt's own."""

    groups: int = 4
    prompts_per_group: int = 8
    system_length: int = 512
    question_length: int = 32
    output_length: int = 32


def shared_prefix(config: SharedPrefixConfig, style: PromptStyle = "tokens", space: TokenSpace | None = None,
                  seed: int = 0) -> Workload:
    """Prompts in a seeded random order, so a group's requests are spread over the run."""
    space = space or TokenSpace()
    sessions: list[Session] = []
    for g in range(config.groups):
        system = Content(style, space, random.Random(f"{seed}:shared:{g}")).piece(config.system_length)
        for p in range(config.prompts_per_group):
            question = Content(style, space, random.Random(f"{seed}:shared:{g}:{p}")).piece(config.question_length)
            spec = RequestSpec(_join(style, system, question), config.output_length, {"group": g, "prompt": p})
            sessions.append(OneShot(spec))
    random.Random(f"{seed}:shared:order").shuffle(sessions)
    params = {**config.__dict__, "style": style, "vocab_size": space.vocab_size, "seed": seed}
    return Workload("shared-prefix", params, sessions)


def _join(style: PromptStyle, system: Any, question: Any) -> Prompt:
    if style == "chat":
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]
    if style == "text":
        return f"{system} {question}"
    return system + question
