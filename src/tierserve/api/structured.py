"""The request fields that ask for structured outputs (docs/structured.md): OpenAI's
``response_format`` and vLLM's ``structured_outputs`` object, to one ``Constraint``."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tierserve.core.constraint import Constraint, ConstraintKind
from tierserve.core.sampling import InvalidRequestError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``{"type": "text"}`` (free text), ``{"type": "json_object"}`` (any JSON object) or
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only with it")
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object"}')
        spec = self.json_schema
        assert spec is not None
        return json_schema(spec.schema_ or {"type": "object"}, bool(spec.strict))


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, as an object or its JSON
    text), ``regex``, ``choice`` (the output is one of these strings) or ``grammar`` (Lark or GBNF)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def constraint(self) -> Constraint:
        given = [(k, v) for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                     ("grammar", self.grammar)) if v is not None]
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs takes exactly one of json, regex, choice or grammar")
        key, value = given[0]
        if key == "json":
            return json_schema(_loads(value) if isinstance(value, str) else value, False)
        if key == "choice":
            return Constraint(ConstraintKind.CHOICE, json.dumps(value))
        return Constraint(ConstraintKind.REGEX if key == "regex" else ConstraintKind.GRAMMAR, str(value))


def json_schema(schema: Any, strict: bool) -> Constraint:
    if not isinstance(schema, dict):
        raise InvalidRequestError("a JSON schema must be a JSON object")
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema), strict)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidRequestError("structured_outputs.json is not valid JSON") from None
