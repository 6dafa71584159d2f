"""Constraints to llguidance grammars: building, checking within bounds, and a bounded cache of
compiled matchers so an agent's repeated schema compiles once (docs/structured.md)."""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance as llg

from tierserve.core.constraint import Constraint, ConstraintKind
from tierserve.core.sampling import InvalidRequestError
from tierserve.structured.state import GrammarState

CACHE_ENTRIES = 256  # compiled grammars kept per engine (and checked ones per API process)
# Bounds on what one grammar may cost to build and to step (llguidance's fuel is work units: ~50k/ms to
# build the lexer, ~14k/ms a mask step): a hostile schema is refused, never left to run.
LIMITS = dict(initial_lexer_fuel=2_000_000, step_lexer_fuel=400_000, max_lexer_states=100_000,
              max_grammar_size=200_000)
# Compact separators, no free whitespace: an output can never idle in whitespace until max_tokens.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def limits() -> llg.LLParserLimits:
    return llg.LLParserLimits(**LIMITS, verbose_errors=False)


def grammar_text(c: Constraint) -> str:
    """llguidance's grammar for ``c``; raises ``InvalidRequestError`` when the spec cannot be read."""
    try:
        if c.kind is ConstraintKind.JSON_SCHEMA:
            overrides = JSON_OPTIONS | {"lenient": not c.strict}
            return llg.LLMatcher.grammar_from_json_schema(c.spec, overrides=overrides)  # type: ignore[arg-type]
        if c.kind is ConstraintKind.REGEX:
            return llg.LLMatcher.grammar_from_regex(c.spec)
        if c.kind is ConstraintKind.CHOICE:
            return llg.grammar_from("lark", "start: " + " | ".join(json.dumps(x) for x in _choices(c.spec)))
        return llg.grammar_from("grammar", c.spec)
    except ValueError as exc:
        raise InvalidRequestError(f"invalid {c.kind.value}: {exc}") from None


def _choices(spec: str) -> list[str]:
    values = json.loads(spec)
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return values


def check(c: Constraint) -> None:
    """Raises ``InvalidRequestError`` unless ``c`` compiles within ``LIMITS`` (no tokenizer needed:
    the API's check; results cached)."""
    problem = _checked(c.key())
    if problem:
        raise InvalidRequestError(problem)


@functools.lru_cache(maxsize=CACHE_ENTRIES)
def _checked(key: tuple[ConstraintKind, str, bool]) -> str:
    """The problem with the constraint ``key`` names ("" if none)."""
    c = Constraint(*key)
    try:
        error = llg.LLMatcher.validate_grammar(grammar_text(c), None, limits=limits())
    except InvalidRequestError as exc:
        error = str(exc).removeprefix(f"invalid {c.kind.value}: ")
    return f"invalid {c.kind.value}: {error}" if error else ""


class GrammarCompiler:
    """Compiles constraints against one tokenizer (a model's ``tokenizer.json`` text) and keeps the
    last ``CACHE_ENTRIES`` compiled matchers; every request gets its own copy (``matcher``)."""

    def __init__(self, tokenizer_json: str, eos_ids: list[int], vocab_size: int) -> None:
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_ids)
        self.vocab_size = vocab_size
        self._compiled = functools.lru_cache(maxsize=CACHE_ENTRIES)(self._compile)  # refusals are not kept

    @property
    def compiles(self) -> int:
        """Grammars compiled so far (the cache's misses)."""
        return self._compiled.cache_info().misses

    def matcher(self, c: Constraint) -> llg.LLMatcher:
        """A fresh matcher for ``c`` at the grammar's start; raises ``InvalidRequestError``."""
        return self._compiled(c.key()).deep_copy()

    def state(self, c: Constraint, prompt_ids: list[int]) -> GrammarState:
        """A request's grammar state after the tokens it generated before a migration (``c.resumed``
        of them, the prompt's last); raises ``InvalidRequestError``."""
        if c.resumed > len(prompt_ids):
            raise InvalidRequestError(f"{c.resumed} resumed tokens but the prompt has {len(prompt_ids)}")
        state = GrammarState(self.matcher(c), self.vocab_size)
        if not state.consume_all(prompt_ids[len(prompt_ids) - c.resumed:]):
            raise InvalidRequestError(f"the resumed output does not match its {c.kind.value}")
        return state

    def _compile(self, key: tuple[ConstraintKind, str, bool]) -> llg.LLMatcher:
        c = Constraint(*key)
        matcher = llg.LLMatcher(self.tokenizer, grammar_text(c), log_level=0, limits=limits())
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {c.kind.value}: {matcher.get_error()}")
        return matcher
