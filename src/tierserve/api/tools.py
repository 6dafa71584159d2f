"""Tool calling's request side (docs/agents.md): the ``tools`` and ``tool_choice`` fields, what the
chat template sees of them, and the grammar that makes ``required`` and a named function valid with
any model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tierserve.core.constraint import Constraint, ConstraintKind
from tierserve.core.sampling import InvalidRequestError

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionSpec(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (no parameters: an empty object)."""
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ToolMode(Enum):
    """``NONE``: free text (tools only in the prompt); ``AUTO``: the model decides, its markup parsed
    (``tool_parsers.py``); ``REQUIRED``: one or more calls, decoded under a grammar; ``NAMED``: one call
    of the named function, its arguments decoded under its parameters' schema."""

    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools: the mode, the tools, whether several calls may come at once."""

    mode: ToolMode
    tools: tuple[Tool, ...]
    parallel: bool = True
    name: str | None = None  # NAMED's function

    @classmethod
    def of(cls, tools: list[Tool] | None, choice: str | NamedToolChoice | None, parallel: bool | None) -> ToolPlan:
        """Raises ``InvalidRequestError`` for a choice that names no given function, or tools whose
        parameters are not a JSON schema object."""
        tools = tools or []
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools must have distinct function names")
        for t in tools:
            if t.function.schema().get("type", "object") != "object":
                raise InvalidRequestError(f"tool {t.function.name!r}: parameters must be a JSON schema of an object")
        mode, name = _mode(choice, bool(tools))
        if name is not None and name not in names:
            raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not among the tools")
        return cls(mode, tuple(tools), parallel is not False, name)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (``tools=``), None without tools."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def constraint(self) -> Constraint | None:
        """The grammar of the output: the named function's arguments, or for ``required`` a JSON list
        of ``{"name", "parameters"}`` calls (at most one unless ``parallel``), as vLLM decodes it."""
        if self.mode is ToolMode.NAMED:
            return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(self._function(self.name).schema()))
        if self.mode is not ToolMode.REQUIRED:
            return None
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": t.function.name}, "parameters": t.function.schema()}}
                 for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        schema |= {} if self.parallel else {"maxItems": 1}
        return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))

    def _function(self, name: str | None) -> FunctionSpec:
        return next(t.function for t in self.tools if t.function.name == name)


def _mode(choice: str | NamedToolChoice | None, has_tools: bool) -> tuple[ToolMode, str | None]:
    if isinstance(choice, NamedToolChoice):
        return ToolMode.NAMED, choice.function.name
    if choice is None:
        return (ToolMode.AUTO if has_tools else ToolMode.NONE), None
    if choice not in ("auto", "none", "required"):
        raise InvalidRequestError(f"tool_choice must be 'auto', 'none', 'required' or a named function, not {choice!r}")
    mode = ToolMode(choice)
    if mode is not ToolMode.NONE and not has_tools:
        raise InvalidRequestError(f"tool_choice {choice!r} needs tools")
    return mode, None
