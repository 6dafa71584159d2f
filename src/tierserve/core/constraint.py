"""What a request's output must match (structured outputs, docs/structured.md): plain data that every
side shares; the grammar library that enforces it lives in ``structured/``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

MAX_SPEC_BYTES = 256 * 1024  # a bound on what one request may ask the grammar compiler to read


class ConstraintKind(Enum):
    """``JSON_SCHEMA``: a JSON schema (``spec`` its JSON text; ``{"type": "object"}`` for any object);
    ``REGEX``: a regular expression (Rust ``regex`` syntax); ``CHOICE``: a JSON list of strings, the
    output one of them; ``GRAMMAR``: a Lark or GBNF grammar (llguidance's syntax)."""

    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class Constraint:
    """The output's grammar. ``strict``: a JSON schema keyword the compiler does not implement is an
    error (else ignored). ``resumed``: the prompt's last ``resumed`` tokens were generated under this
    constraint already (a migration: docs/migration.md), so the grammar starts after them."""

    kind: ConstraintKind
    spec: str
    strict: bool = False
    resumed: int = 0

    def after(self, tokens: int) -> Constraint:
        """The constraint of a request continued after ``tokens`` more generated tokens."""
        return replace(self, resumed=self.resumed + tokens)

    def key(self) -> tuple[ConstraintKind, str, bool]:
        """What decides the compiled grammar (``resumed`` does not)."""
        return self.kind, self.spec, self.strict
