"""Text ⇄ token ids and chat templates for a model folder, without torch or transformers.

The router tokenizes and applies chat templates too, and it must not import torch, so this module
depends only on ``tokenizers`` and ``jinja2``. Chat templates render exactly as
``transformers``' ``apply_chat_template(..., tokenize=False)`` does: same jinja2 sandbox settings,
same helpers (``raise_exception``, ``tojson``, ``strftime_now``, ``namespace``, ``dict``), the same
special tokens in scope.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (``raise_exception``) or cannot be rendered."""


class TextTokenizer:
    """A model folder's fast tokenizer plus its ``tokenizer_config.json`` (special tokens, chat
    template) and ``chat_template.jinja`` (the chat template, as recent ``transformers`` save it).

    ``encode`` adds the BOS token only when the config says ``add_bos_token: true`` (or the
    tokenizer's own post-processor adds special tokens), like ``transformers``' ``encode``.
    """

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any], eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.special_tokens = _special_tokens(config)
        self.chat_template: str | None = _pick_template(config.get("chat_template"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id = tokenizer.token_to_id(bos) if bos else None
        eos = self.special_tokens.get("eos_token")
        eos_id = tokenizer.token_to_id(eos) if eos else None
        self.eos_token_ids = eos_token_ids | ({eos_id} if eos_id is not None else set())
        self.tool_call_parser: str | None = None  # --tool-call-parser (None: chosen by the template)

    @classmethod
    def from_dir(cls, folder: str | Path) -> TextTokenizer:
        """Loads ``tokenizer.json`` (required) and the optional configs next to it."""
        folder = Path(folder)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # tokenizer_config.json wins over the older special_tokens_map.json, as in transformers.
        config = _read_json(folder / "special_tokens_map.json") | _read_json(folder / "tokenizer_config.json")
        jinja = folder / "chat_template.jinja"  # where recent transformers save it; it wins, as there
        if jinja.is_file():
            config["chat_template"] = jinja.read_text(encoding="utf-8")
        eos = _ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
        eos |= _ids(_read_json(folder / "config.json").get("eos_token_id"))
        return cls(tokenizer, config, frozenset(eos))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens=False`` for text that already holds them
        (a rendered chat template)."""
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> str:
        """Renders ``messages`` (dicts with ``role`` and ``content``) into the prompt text; ``tools``:
        the request's tools in OpenAI's shape, as ``transformers`` passes them (docs/agents.md).

        Raises ``ChatTemplateError`` when the folder has no template or the template rejects the
        conversation. Extra ``kwargs`` are visible to the template, as in ``transformers``.
        """
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        scope = {**self.special_tokens, **kwargs}
        try:
            template = _compile(self.chat_template)
            return template.render(
                messages=messages, tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **scope,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc


def try_load(folder: str | Path, chat_template: Path | None = None,
             tool_call_parser: str | None = None) -> TextTokenizer | None:
    """The folder's tokenizer, or None when it has no ``tokenizer.json`` (token-id-only models);
    ``chat_template``: a Jinja file that replaces the folder's template (``--chat-template``, e.g. one
    that knows tools); ``tool_call_parser``: ``--tool-call-parser`` (docs/agents.md)."""
    if not (Path(folder) / "tokenizer.json").is_file():
        return None
    tokenizer = TextTokenizer.from_dir(folder)
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text(encoding="utf-8")
    tokenizer.tool_call_parser = tool_call_parser
    return tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """``bos_token``, ``eos_token``... as strings; configs store them as strings or AddedToken dicts."""
    out = {}
    for key, value in config.items():
        if not key.endswith("_token"):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _pick_template(template: Any) -> str | None:
    """Configs may hold a list of named templates; the one named ``default`` is the chat template."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: Any = None, sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, closing a known sandbox escape (as transformers)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's trick: a field may be named self
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates cannot set underscore attributes: {name!r}")


class _DictFactory:
    """``dict(...)`` in templates without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` renders its body unchanged (transformers uses it only to
    find assistant tokens for training masks)."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's declared class attribute

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@cache
def _compile(template: str) -> jinja2.Template:
    # Templates come from model repositories: untrusted code, hence the immutable sandbox.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now,
        namespace=_Namespace, dict=_DictFactory(),
    )
    return env.from_string(template)
