"""Tool calls out of generated text, as it streams (docs/agents.md): one reader per choice turns text
deltas into content deltas and OpenAI's ``tool_calls`` deltas, and at the end holds the whole calls.

``hermes``: Qwen2/Qwen3 markup, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
``llama3_json``: Llama 3's bare ``{"name": ..., "parameters": {...}}`` objects (``;`` between calls);
``required`` and ``named``: the shapes ``ToolPlan.constraint`` decodes under (always valid)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tierserve.api.tools import ToolMode, ToolPlan

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ToolParserKind(Enum):
    """``--tool-call-parser``: the model family's tool-call markup (vLLM's names)."""

    HERMES = "hermes"  # Qwen2, Qwen2.5, Qwen3
    LLAMA3_JSON = "llama3_json"

    @classmethod
    def for_template(cls, template: str | None) -> ToolParserKind:
        """The default: Hermes markup when the chat template speaks it, else Llama 3's JSON."""
        return cls.HERMES if template and OPEN in template else cls.LLAMA3_JSON


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Reader:
    """Base: text passes as content. ``feed`` and ``finish`` return (content, tool-call deltas)."""

    calls: list[ToolCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.content.append(text)
        return text, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return "", []

    def _call(self, name: str, arguments: Any) -> dict[str, Any]:
        """Records a whole call; its delta, the first and only one of that call."""
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        call = ToolCall(_call_id(), name, text)
        self.calls.append(call)
        return {"index": len(self.calls) - 1} | call.message()

    def _text(self, text: str) -> str:
        self.content.append(text)
        return text


class HermesReader(Reader):
    """``<tool_call>`` JSON ``</tool_call>`` blocks anywhere in the text; the rest is content. A tag's
    first characters are held back until it is clear whether a tag starts there."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer, self.inside = "", False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        out, deltas = "", []
        while True:
            if self.inside:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return out, deltas
                body, self.buffer, self.inside = self.buffer[:end], self.buffer[end + len(CLOSE):], False
                delta = self._block(body)
                out += "" if delta else self._text(OPEN + body + CLOSE)
                deltas += [delta] if delta else []
                continue
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buffer, OPEN)
                out += self._text(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out, deltas
            out += self._text(self.buffer[:start])
            self.buffer, self.inside = self.buffer[start + len(OPEN):], True

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        rest, inside, self.buffer = self.buffer, self.inside, ""
        delta = self._block(rest) if inside else None
        if delta:
            return "", [delta]
        return self._text(OPEN + rest if inside else rest), []

    def _block(self, body: str) -> dict[str, Any] | None:
        call = _loads(body)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        return self._call(call["name"], call.get("arguments", {}))


class Llama3JsonReader(Reader):
    """Text that opens with ``{`` is calls (held until the end, then parsed; not calls: content);
    any other text is content as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer, self.calls_mode = "", None  # None: nothing but whitespace seen yet

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        if self.calls_mode is None and self.buffer.strip():
            self.calls_mode = self.buffer.lstrip().startswith("{")
        if self.calls_mode is False:
            out, self.buffer = self.buffer, ""
            return self._text(out), []
        return "", []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        rest, self.buffer = self.buffer, ""
        objects = _json_objects(rest) if self.calls_mode else None
        if not objects or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in objects):
            return self._text(rest), []
        return "", [self._call(o["name"], o.get("parameters", o.get("arguments", {}))) for o in objects]


class RequiredReader(Reader):
    """A JSON list of ``{"name", "parameters"}`` objects; each call's delta as soon as its object closes."""

    def __init__(self) -> None:
        super().__init__()
        self.scanner = _ObjectScanner()

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        deltas = []
        for body in self.scanner.feed(text):
            call = _loads(body)
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                deltas.append(self._call(call["name"], call.get("parameters", {})))
        return "", deltas


class NamedReader(Reader):
    """The text is the named function's arguments: a header delta, then argument fragments as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if not self.calls:
            return "", [self._call(self.name, text)]
        self.calls[0].arguments += text
        return "", [{"index": 0, "function": {"arguments": text}}] if text else []


def reader_for(plan: ToolPlan, parser: ToolParserKind) -> Reader:
    """A fresh reader for one choice of a request with ``plan``."""
    if plan.mode is ToolMode.NAMED:
        return NamedReader(plan.name or "")
    if plan.mode is ToolMode.REQUIRED:
        return RequiredReader()
    if plan.mode is ToolMode.AUTO:
        return HermesReader() if parser is ToolParserKind.HERMES else Llama3JsonReader()
    return Reader()


class _ObjectScanner:
    """Finds the top-level objects of a JSON list as its text streams in (strings and escapes aware)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.current = 0, False, False, []

    def feed(self, text: str) -> list[str]:
        done = []
        for ch in text:
            if self.depth >= 2 or (self.depth == 1 and ch == "{"):
                self.current.append(ch)
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and ch == "}":
                    done.append("".join(self.current))
                    self.current = []
        return done


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def _json_objects(text: str) -> list[Any] | None:
    """The JSON values of ``text`` separated by whitespace or ``;``; None when it is not that."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
