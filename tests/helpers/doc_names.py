"""Backticked code names in the docs, and whether the code still has them (``tests/test_layers.py``).

What counts as a code name inside a `code span` of a Markdown file (fenced blocks are skipped):
- a path: a word with a ``/`` that starts with a repository folder (``src/``, ``tests/``, ...) or ends in
  ``/`` or a source extension, or a bare ``name.py``: some file or folder of the repository must end with it
  (``engine/cp/gather.py`` names ``src/tierserve/engine/cp/gather.py``);
- a flag: every ``--flag`` in a span (not a family such as ``--hicache-*``), which must appear in the code
  (``src/``, ``benchmarks/``, ``deploy/``, ``scripts/``), literally or as an f-string (``f"--{role}-args"``);
- a dotted name (``Class.member``, ``module.attr``, ``launch.probes.port_taken``), optionally called
  (``Engine.step(...)``): a class's member must be defined in the class or a base, a module's attribute at
  the module's top level; a Python string literal of the code that is the whole dotted name (a span or
  attribute name, ``tierserve.kv_handoff``) passes too; a dotted name whose head is neither, or only a
  top-level package that is also a variable's name (``cache.match``), is checked word by word, as below;
- a single identifier that looks like code: CamelCase or capitalised (``HiCache``, ``Engine``), with an
  underscore (``_write_now``, ``DEFAULT_THRESHOLD``) or called (``dirty_lru()``): the word must occur in the
  code (strings included, since config keys and enum values are strings).
Metric names are built at run time from the counters' keys: ``tierserve_router_retries_total{path}`` passes
when the code has ``retries`` (labels, the ``tierserve_`` prefix, one family word after it and the ``_total``
suffix may be dropped). Anything
else in backticks (JSON, shell lines, numbers, plain words, HTTP routes) is not checked.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

CODE_DIRS = ("src", "tests", "benchmarks", "deploy", "scripts")  # where names are looked up (paths: docs/ too)
FLAG_DIRS = ("src", "benchmarks", "deploy", "scripts")  # where a documented flag must be defined or passed
REPO_DIRS = ("src/", "tests/", "benchmarks/", "deploy/", "docs/", "scripts/")
SOURCE_EXTENSIONS = (".py", ".pyi", ".proto", ".yaml", ".yml", ".md", ".sh", ".toml", ".txt", ".cfg")
TEXT_EXTENSIONS = (".py", ".pyi", ".proto", ".yaml", ".yml", ".sh", ".toml", ".cfg", "Dockerfile", "Makefile")
SKIPPED_DIRS = {".git", ".venv", "__pycache__", "node_modules", ".pytest_cache", ".ruff_cache"}

SPAN = re.compile(r"`([^`]+)`")
FENCE = re.compile(r"^\s*(```|~~~)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*(?![\w*-])")  # not a family: `--hicache-*`
FLAG_TEMPLATE = re.compile(r"--(?:[a-z0-9-]*\{\w+\})+[a-z0-9-]*")  # f"--{role}-args" in the code
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
CALL = re.compile(r"\((?:[^()]|\([^()]*\))*\)$")  # a trailing argument list, one level of nesting
LABELS = re.compile(r"\{[\w,=\"' ]*\}$")  # a metric's labels
PATHLIKE = re.compile(r"[\w.*-]+(?:/[\w.*-]*)+|[\w-]+\.(?:py|pyi|proto|sh)")


class Kind(Enum):
    """What a backticked word names, which decides where it is looked up."""

    PATH = "path"
    FLAG = "flag"
    DOTTED = "dotted"
    WORD = "word"


@dataclass(frozen=True)
class DocName:
    """One code name in a doc: its line (1-based) and kind."""

    line: int
    name: str
    kind: Kind


@dataclass
class CodeIndex:
    """What the code defines, as the lookups need it."""

    paths: set[str] = field(default_factory=set)  # every file and folder, relative to the root
    words: set[str] = field(default_factory=set)  # every word of every source text, strings included
    flags: set[str] = field(default_factory=set)  # every literal --flag of the flag folders
    flag_templates: list[re.Pattern[str]] = field(default_factory=list)  # f"--{role}-args" as a pattern
    classes: dict[str, set[str]] = field(default_factory=dict)  # class name -> members (every class of that name)
    bases: dict[str, set[str]] = field(default_factory=dict)  # class name -> base class names
    modules: dict[str, set[str]] = field(default_factory=dict)  # dotted module -> its top-level names
    strings: set[str] = field(default_factory=set)  # Python string literals that are dotted names (span names)


def _outside_fences(text: str) -> str:
    """``text`` with fenced code blocks blanked out, line numbers kept."""
    lines, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return "\n".join(lines)


def code_spans(text: str) -> Iterator[tuple[int, str]]:
    """Each inline code span of Markdown ``text`` outside fenced blocks, with its first line (1-based)."""
    text = _outside_fences(text)
    for match in SPAN.finditer(text):
        yield text.count("\n", 0, match.start()) + 1, " ".join(match.group(1).split())


def _is_path(word: str) -> bool:
    if word.startswith(("/", ".")) or not PATHLIKE.fullmatch(word) or "*" in word:
        return False
    return "/" not in word or word.startswith(REPO_DIRS) or word.endswith(("/", *SOURCE_EXTENSIONS))


def _looks_like_code(word: str, called: bool) -> bool:
    """Called, CamelCase or Capitalised (a class), or with an underscore: plain lowercase words are prose."""
    return called or (word[0].isupper() and any(c.islower() for c in word)) or "_" in word


def classify(span: str) -> list[tuple[str, Kind]]:
    """The code names in one code span (none for JSON, prose, numbers or routes)."""
    names = [(flag, Kind.FLAG) for flag in FLAG.findall(span)]
    if span.startswith(("{", "[", "-")) or '"' in span:
        return names
    head = span.split(" ", 1)[0]
    if _is_path(head):
        return [*names, (head, Kind.PATH)]
    if " " in span:
        return names
    bare = LABELS.sub("", CALL.sub("", span))
    called = bare != LABELS.sub("", span)
    if not DOTTED.fullmatch(bare):
        return names
    if "." in bare:
        return [*names, (bare, Kind.DOTTED)]
    return [*names, (bare, Kind.WORD)] if _looks_like_code(bare, called) else names


def doc_names(text: str) -> list[DocName]:
    """Every code name of a Markdown text, in order."""
    return [DocName(line, name, kind) for line, span in code_spans(text) for name, kind in classify(span)]


def _members(tree: ast.ClassDef) -> set[str]:
    """Names a class defines: methods, nested classes, class attributes and fields (its body's own
    assignments), and ``self.x`` / ``cls.x`` assignments in its methods."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.update(n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                         and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
    return names


def _top_level(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        else:
            names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    return names


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[0] == "src":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _index_python(index: CodeIndex, rel: Path, text: str) -> None:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    index.modules.setdefault(_module_name(rel), set()).update(_top_level(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            index.classes.setdefault(node.name, set()).update(_members(node))
            bases = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                     if isinstance(b, ast.Name | ast.Attribute)}
            index.bases.setdefault(node.name, set()).update(bases)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
            index.strings.add(node.value)


def _files(root: Path, dirs: Iterable[str]) -> Iterator[Path]:
    for top in dirs:
        for path in sorted((root / top).rglob("*")):
            if not SKIPPED_DIRS.intersection(path.relative_to(root).parts):
                yield path


def index_code(root: Path, code_dirs: Iterable[str] = CODE_DIRS, flag_dirs: Iterable[str] = FLAG_DIRS) -> CodeIndex:
    """Scans the code folders under ``root`` (and every file at the top) into a ``CodeIndex``."""
    index, flag_dirs = CodeIndex(), tuple(flag_dirs)
    index.paths.update(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())
    flag_texts: list[str] = []
    code_dirs = tuple(code_dirs)
    for path in _files(root, [d for d in (*code_dirs, "docs") if (root / d).is_dir()]):
        rel = path.relative_to(root)
        index.paths.add(rel.as_posix() + ("/" if path.is_dir() else ""))
        if path.is_dir() or rel.parts[0] not in code_dirs or not path.name.endswith(TEXT_EXTENSIONS):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        index.words.update(WORD.findall(text))
        if rel.parts[0] in flag_dirs:
            flag_texts.append(text)
        if path.suffix in (".py", ".pyi"):
            _index_python(index, rel, text)
    text = "\n".join(flag_texts)
    index.flags = set(FLAG.findall(text))
    index.flag_templates = [re.compile(re.sub(r"\\\{\w+\\\}", "[a-z0-9]+", re.escape(template)))
                            for template in set(FLAG_TEMPLATE.findall(text))]
    return index


def _has_member(index: CodeIndex, cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
    if member in index.classes.get(cls, ()):
        return True
    return any(_has_member(index, base, member, seen | {cls}) for base in index.bases.get(cls, ()) - seen)


def _modules(index: CodeIndex, dotted: str) -> list[str]:
    """The code's modules a dotted name may mean: itself, or one it ends (``cache.events``:
    ``tierserve.cache.events``)."""
    return [m for m in index.modules if m == dotted or m.endswith("." + dotted)]


def _module_prefix(index: CodeIndex, parts: list[str]) -> int:
    """How many leading parts of a dotted name name a module of the code."""
    return next((n for n in range(len(parts), 0, -1) if _modules(index, ".".join(parts[:n]))), 0)


def _dotted_problem(index: CodeIndex, name: str) -> str | None:
    if name in index.strings:  # spelled out whole in the code: a span or attribute name (docs/tracing.md)
        return None
    parts = name.split(".")
    n = _module_prefix(index, parts)
    if n == len(parts):
        return None
    module = ".".join(parts[:n])
    if n and any(parts[n] in index.modules[m] for m in _modules(index, module)):
        return None
    if n > 1 or (n == 1 and parts[0] == "tierserve"):  # a lone package name may be a variable's: `cache.match`
        return f"module {module} has no {parts[n]}"
    if parts[0] in index.classes:
        return None if _has_member(index, parts[0], parts[1]) else f"class {parts[0]} has no {parts[1]}"
    missing = [part for part in parts if part not in index.words]  # an instance's attribute, a config key
    return f"no {', '.join(missing)} in the code" if missing else None


def _path_exists(index: CodeIndex, path: str) -> bool:
    want = path.rstrip("/")
    return any(have.rstrip("/") == want or have.rstrip("/").endswith("/" + want) for have in index.paths)


def problem(index: CodeIndex, name: str, kind: Kind) -> str | None:
    """Why ``name`` is stale, or None when the code has it."""
    if kind is Kind.PATH:
        return None if _path_exists(index, name) else "no such file or folder"
    if kind is Kind.FLAG:
        known = name in index.flags or any(t.fullmatch(name) for t in index.flag_templates)
        return None if known else "no such flag in the code"
    if kind is Kind.DOTTED:
        return _dotted_problem(index, name)
    return None if _metric_keys(name) & index.words else "not in the code"


def _metric_keys(word: str) -> set[str]:
    """The word itself, and for a metric the keys it may be built from."""
    keys = {word}
    if word.startswith("tierserve_"):
        rest = word.removeprefix("tierserve_")
        for key in (rest, rest.partition("_")[2]):
            keys.update({key, key.removesuffix("_total")} - {""})
        keys.add(word.removesuffix("_total"))
    return keys


def stale_names(root: Path, docs: Iterable[Path], allowed: Mapping[str, str] | None = None,
                index: CodeIndex | None = None) -> list[str]:
    """``doc:line: `name` (why)`` for every code name in ``docs`` the code under ``root`` lacks, except the
    names in ``allowed`` (name -> why it is not in the code)."""
    index = index or index_code(root)
    allowed = allowed or {}
    stale = []
    for doc in docs:
        shown = doc.relative_to(root).as_posix() if doc.is_relative_to(root) else str(doc)
        for found in doc_names(doc.read_text(encoding="utf-8")):
            why = None if found.name in allowed else problem(index, found.name, found.kind)
            if why:
                stale.append(f"{shown}:{found.line}: `{found.name}` ({why})")
    return stale
