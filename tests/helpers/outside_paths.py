"""Where the tests' source names a place outside the repository: the check behind "no test reads
outside the repository" (``tests/test_layers.py``), so that a clone of the repository alone passes.

``outside_paths(repo, "tests")`` reads every ``.py`` file under ``repo/tests`` with ``ast`` and returns one
message per line that breaks one of these rules (none: the rule holds):
1. A path computed from ``__file__`` stays inside the repository. The climb is followed through
   ``Path(...)``, ``.resolve()``, ``.absolute()``, ``.parent``, ``.parents[N]``, ``os.path.dirname``,
   ``/ "literal"`` and module-level names bound to such a path: ``Path(__file__).parents[2]`` in
   ``tests/x.py`` is the folder beside the checkout and fires.
2. No string literal has a ``..`` path component (``"../beside/traces"``): it climbs from wherever
   the test runs.
3. No string literal is an absolute path under a folder holding people's or the machine's files
   (``DATA_ROOTS``: ``/home``, ``/srv``, ``/etc``, ...). ``/proc``, ``/sys``, ``/dev`` (the kernel's)
   and ``/tmp`` (scratch) are allowed, and ``/v1/models``-like strings are URL paths, not files.
4. The home folder only as the model cache ``make test`` fills (``scripts/setup.sh``, ``make model``):
   ``Path.home()`` only as ``Path.home() / ".cache" / "tierserve" ...``, ``"~..."`` literals only under
   ``~/.cache/tierserve``, and ``HOME`` is never read from the environment.
Docstrings are prose, not paths, and are skipped. Paths joined from variables at run time, and names
bound inside functions, are beyond a static scan.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

DATA_ROOTS = frozenset({"work", "home", "root", "Users", "mnt", "media", "srv", "opt", "data", "shared",
                        "scratch", "etc", "usr", "var", "Volumes"})
HOME_CACHE = (".cache", "tierserve")  # the model cache under the home folder that `make test` prepares


def dotted(node: ast.expr) -> str:
    """``a.b.c`` for a chain of names and attributes, else ``""``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def normal(path: Path) -> Path:
    """``path`` with ``..`` and ``.`` folded away, without touching the filesystem."""
    return Path(os.path.normpath(path))


class Climb:
    """Follows paths computed from ``__file__`` in one file; ``names`` holds module-level bindings."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.names: dict[str, Path] = {}

    def path(self, node: ast.expr) -> Path | None:
        """The path ``node`` computes from ``__file__``, or None when it is no such computation."""
        if isinstance(node, ast.Name):
            return self.file if node.id == "__file__" else self.names.get(node.id)
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.Attribute) and node.attr == "parent":
            base = self.path(node.value)
            return base.parent if base else None
        if isinstance(node, ast.Subscript):
            return self.parents(node)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant):
            base = self.path(node.left)
            return normal(base / str(node.right.value)) if base else None
        return None

    def call(self, node: ast.Call) -> Path | None:
        """``Path(x)``, ``x.resolve()``, ``x.absolute()``, ``os.path.dirname(x)`` and the like."""
        name, args = dotted(node.func), node.args
        if name in ("Path", "pathlib.Path", "os.path.abspath", "os.path.realpath") and len(args) == 1:
            return self.path(args[0])
        if name in ("os.path.dirname", "dirname") and len(args) == 1:
            base = self.path(args[0])
            return base.parent if base else None
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("resolve", "absolute"):
            return self.path(node.func.value)
        return None

    def parents(self, node: ast.Subscript) -> Path | None:
        """``x.parents[N]``; past the filesystem root it stays at the root."""
        if not (isinstance(node.value, ast.Attribute) and node.value.attr == "parents"
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)):
            return None
        base = self.path(node.value.value)
        if base is None:
            return None
        chain = base.parents
        return chain[node.slice.value] if node.slice.value < len(chain) else Path(base.anchor)

    def bind(self, tree: ast.Module) -> None:
        """Record the module-level names bound to a path from ``__file__``, in order."""
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None:
                path = self.path(stmt.value)
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for target in targets:
                    if path is not None and isinstance(target, ast.Name):
                        self.names[target.id] = path


def inside(path: Path, repo: Path) -> bool:
    """True when ``path`` is ``repo`` or below it."""
    return path == repo or repo in path.parents


def docstrings(tree: ast.Module) -> set[int]:
    """The ids of string constants that stand alone as statements (docstrings and the like)."""
    return {id(stmt.value) for stmt in ast.walk(tree)
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)}


def climbs(tree: ast.Module, file: Path, repo: Path) -> Iterator[tuple[int, str]]:
    """Rule 1: the paths from ``__file__`` that leave ``repo``, the outermost expression's once per line."""
    climb, lines = Climb(file), set()
    climb.bind(tree)
    for node in ast.walk(tree):  # breadth first: a whole expression comes before its parts
        made = isinstance(node, ast.expr) and not isinstance(node, ast.Name)  # where a path is made, not used
        path = climb.path(node) if made and node.lineno not in lines else None
        if path is not None and not inside(normal(path), repo):
            lines.add(node.lineno)
            yield node.lineno, f"climbs from __file__ out of the repository, to {os.path.relpath(path, repo)}"


def literal_problem(text: str) -> str | None:
    """Rules 2, 3 and the ``~`` part of 4 on one string literal."""
    home = os.path.expanduser(text)  # changed only when ``text`` starts with the home sign
    if home != text and not inside(normal(Path(home)), Path.home() / ".cache" / "tierserve"):
        return "the home folder, other than ~/.cache/tierserve"
    if " " in text or "\n" in text:
        return None
    parts = PurePosixPath(text).parts
    if os.pardir in parts:
        return "a path that climbs with '..'"
    if len(parts) > 1 and parts[0] == "/" and parts[1] in DATA_ROOTS:
        return "an absolute path outside the repository"
    return None


def literals(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Rules 2 and 3 (and ``~``): string literals naming places outside the repository."""
    prose = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            problem = literal_problem(node.value)
            if problem:
                yield node.lineno, f"names {node.value!r}, {problem}"


def cache_homes(tree: ast.Module) -> set[int]:
    """The ids of ``Path.home()`` calls that open a chain ``/ ".cache" / "tierserve"``."""
    allowed = set()
    for node in ast.walk(tree):
        parts: list[ast.expr] = []
        while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            parts.insert(0, node.right)
            node = node.left
        names = [p.value for p in parts[: len(HOME_CACHE)] if isinstance(p, ast.Constant)]
        if tuple(names) == HOME_CACHE:
            allowed.add(id(node))
    return allowed


def home_reads(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Rule 4: ``Path.home()`` other than the model cache, and ``HOME`` read from the environment."""
    allowed = cache_homes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and dotted(node.func) in ("Path.home", "pathlib.Path.home"):
            if id(node) not in allowed:
                yield node.lineno, "reads the home folder (Path.home()), other than ~/.cache/tierserve"
        elif reads_home_variable(node):
            yield node.lineno, "reads HOME from the environment"


def reads_home_variable(node: ast.AST) -> bool:
    """``os.environ["HOME"]`` (read), ``os.getenv("HOME")`` or ``os.environ.get("HOME")``."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and dotted(node.value) == "os.environ":
        return isinstance(node.slice, ast.Constant) and node.slice.value == "HOME"
    if isinstance(node, ast.Call) and dotted(node.func) in ("os.getenv", "getenv", "os.environ.get") and node.args:
        first = node.args[0]
        return isinstance(first, ast.Constant) and first.value == "HOME"
    return False


def file_problems(file: Path, repo: Path) -> list[str]:
    """Every rule's messages for one file, ``file:line what``, in line order."""
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    shown = file.relative_to(repo).as_posix()
    found = sorted({*climbs(tree, file, repo), *literals(tree), *home_reads(tree)})
    return [f"{shown}:{line} {what}" for line, what in found]


def outside_paths(repo: Path, folder: str = "tests") -> list[str]:
    """Rules 1-4 over every ``.py`` file under ``repo/folder`` (``repo`` is made absolute first)."""
    repo = normal(repo.resolve())
    return [msg for file in sorted((repo / folder).rglob("*.py")) for msg in file_problems(file, repo)]
