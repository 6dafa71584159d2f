"""A static map of the imports inside one Python package, and the layering checks run on it.

``scan(root, package)`` reads every ``.py`` file under ``root`` (the directory of ``package``) with
``ast`` and records each import statement that can run: module level or nested in a function or a
class, ``import a.b`` and ``from a import b`` and relative forms, except those inside the body of an
``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:`` block. ``from p import name`` is recorded as the
submodule ``p.name`` when that file exists in the package, else as ``p``.

A *unit* is a top-level package or module of the scanned package (``router`` for ``pkg.router.app``,
``launch`` for ``pkg.launch``, ``__init__`` for ``pkg`` itself). The check functions return one
message per violation, each naming the file, the line and the imported module; no message means
the rule holds. Dynamic imports (``importlib.import_module``) are invisible to this scan.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

ROOT_UNIT = "__init__"


@dataclass(frozen=True)
class Import:
    """One import statement's effect: ``module`` (in file ``file``, line ``line``) imports ``target``."""

    module: str
    file: str
    line: int
    target: str

    def where(self) -> str:
        """``file:line imports target``, the head of every violation message."""
        return f"{self.file}:{self.line} imports {self.target}"


@dataclass(frozen=True)
class Scan:
    """The modules of ``package`` (dotted names, the package itself included) and their imports."""

    package: str
    modules: frozenset[str]
    imports: tuple[Import, ...]


def module_name(root: Path, package: str, file: Path) -> str:
    """The dotted name of ``file`` under ``root``; an ``__init__.py`` names its package."""
    parts = [package, *file.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def find_modules(root: Path, package: str) -> dict[str, Path]:
    """Every ``.py`` file under ``root`` by its dotted module name."""
    return {module_name(root, package, f): f for f in sorted(root.rglob("*.py"))}


def is_type_checking(test: ast.expr) -> bool:
    """True for the conditions ``TYPE_CHECKING`` and ``<anything>.TYPE_CHECKING``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def runtime_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements below ``node`` at any depth, minus the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        yield from runtime_imports_at(child)


def runtime_imports_at(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """``node`` itself if it is an import, else the runtime imports below it: of an
    ``if TYPE_CHECKING:`` only its ``else`` branch counts."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    elif isinstance(node, ast.If) and is_type_checking(node.test):
        for stmt in node.orelse:
            yield from runtime_imports_at(stmt)
    else:
        yield from runtime_imports(node)


def from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module named before ``import`` in ``node``, resolving ``.``/``..`` from ``module``."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def import_targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
                   modules: frozenset[str]) -> list[str]:
    """The modules ``node`` imports: each ``import`` name, or per ``from`` name the submodule if it exists."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = from_base(node, module, is_package)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def file_imports(module: str, path: Path, shown: str, modules: frozenset[str]) -> list[Import]:
    """The runtime imports of the file ``path`` (module ``module``), with ``shown`` as its path in messages."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [Import(module, shown, node.lineno, target)
            for node in runtime_imports(tree)
            for target in dict.fromkeys(import_targets(node, module, is_package, modules))]


def scan(root: Path, package: str, shown_from: Path | None = None) -> Scan:
    """Scan the package ``package`` whose directory is ``root``; file paths in messages are shown
    relative to ``shown_from`` (default: the directory holding ``root``)."""
    files = find_modules(root, package)
    modules = frozenset(files)
    base = shown_from or root.parent
    imports = [imp for name, path in files.items()
               for imp in file_imports(name, path, path.relative_to(base).as_posix(), modules)]
    return Scan(package, modules, tuple(imports))


def unit_of(module: str, package: str) -> str | None:
    """The top-level unit of ``module`` inside ``package``, or None for a module outside it."""
    if module == package:
        return ROOT_UNIT
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1:].split(".")[0]


def short(module: str, package: str) -> str:
    """``module`` without the ``package.`` prefix (the package itself keeps its name), for chains."""
    return module[len(package) + 1:] if module.startswith(package + ".") else module


def within(module: str, prefixes: Iterable[str]) -> bool:
    """True when ``module`` is one of the dotted ``prefixes`` or lies below one."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def forbidden_violations(scan: Scan, unit: str, forbidden: Iterable[str]) -> list[str]:
    """Imports made by modules of ``unit`` of any module of the units ``forbidden``."""
    banned = set(forbidden)
    return [f"{imp.where()} ({unit} must not import {unit_of(imp.target, scan.package)})"
            for imp in scan.imports
            if unit_of(imp.module, scan.package) == unit and unit_of(imp.target, scan.package) in banned]


def allowlist_violations(scan: Scan, allowed: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Imports of the package made by a unit in ``allowed`` outside itself and its allowed dotted
    sub-names (relative to the package: ``"cache.hashing"``)."""
    out = []
    for imp in scan.imports:
        unit = unit_of(imp.module, scan.package)
        if unit not in allowed or unit_of(imp.target, scan.package) is None:
            continue
        ok = [f"{scan.package}.{name}" for name in (unit, *allowed[unit])]
        if not within(imp.target, ok):
            out.append(f"{imp.where()} ({unit} may import only {', '.join(allowed[unit]) or unit})")
    return out


def units(scan: Scan) -> set[str]:
    """The units of the package: one per top-level package or module, ``__init__`` for the package itself."""
    return {unit for unit in (unit_of(m, scan.package) for m in scan.modules) if unit}


def unplaced_violations(scan: Scan, placed: Iterable[str]) -> list[str]:
    """One message per unit of the package that ``placed`` does not name."""
    return [f"{scan.package}.{unit} has no row in the layering table (give it one)"
            for unit in sorted(units(scan) - set(placed))]


def executed(target: str, scan: Scan) -> list[str]:
    """What importing ``target`` runs, as graph nodes: for a module of the package, its parent
    packages and the nearest existing module at or above it; for anything else, its top-level name."""
    if unit_of(target, scan.package) is None:
        return [target.split(".")[0]]
    parts = target.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return [p for p in prefixes if p in scan.modules]


def module_graph(scan: Scan) -> dict[str, list[tuple[str, Import]]]:
    """For each module of the package, the nodes its imports run, each with the import responsible."""
    graph: dict[str, list[tuple[str, Import]]] = {m: [] for m in scan.modules}
    for imp in scan.imports:
        graph[imp.module].extend((node, imp) for node in executed(imp.target, scan) if node != imp.module)
    return graph


def path_to(start: str, graph: Mapping[str, list[tuple[str, Import]]],
            goals: Iterable[str]) -> list[tuple[str, Import]] | None:
    """The shortest chain of (node, import) steps from ``start`` to a node in ``goals``, or None."""
    goal_set, seen = set(goals), {start}
    queue: deque[tuple[str, list[tuple[str, Import]]]] = deque([(start, [])])
    while queue:
        node, chain = queue.popleft()
        for nxt, imp in graph.get(node, []):
            if nxt in goal_set:
                return [*chain, (nxt, imp)]
            if nxt not in seen:
                seen.add(nxt)
                queue.append((nxt, [*chain, (nxt, imp)]))
    return None


def heavy_import_violations(scan: Scan, units: Iterable[str], heavy: Iterable[str]) -> list[str]:
    """Modules of ``units`` from which a top-level name in ``heavy`` is imported, directly or through
    other modules of the package (parent ``__init__``s included); the shortest chain is reported."""
    graph, unit_set, goals = module_graph(scan), set(units), tuple(heavy)
    out = []
    for module in sorted(m for m in scan.modules if unit_of(m, scan.package) in unit_set):
        chain = path_to(module, graph, goals)
        if chain:
            names = " -> ".join(short(n, scan.package) for n in [module, *(node for node, _ in chain)])
            out.append(f"{chain[0][1].where()}, which leads to {chain[-1][0]}: {names}")
    return out


def unit_edges(scan: Scan) -> dict[str, dict[str, Import]]:
    """Edges between distinct units, each with the first import (in scan order) that makes it."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in scan.imports:
        a, b = unit_of(imp.module, scan.package), unit_of(imp.target, scan.package)
        if a and b and a != b:
            edges.setdefault(a, {}).setdefault(b, imp)
    return edges


def cycle_through(unit: str, edges: Mapping[str, Mapping[str, Import]]) -> list[str] | None:
    """The shortest cycle of units from ``unit`` back to itself (``[unit, ..., unit]``), or None."""
    graph = {a: [(b, imp) for b, imp in targets.items()] for a, targets in edges.items()}
    chain = path_to(unit, graph, [unit])
    return [unit, *(node for node, _ in chain)] if chain else None


def canonical(cycle: list[str]) -> tuple[str, ...]:
    """A cycle ``[a, ..., a]`` rotated to start at its smallest unit, to recognise repeats."""
    ring = cycle[:-1]
    i = ring.index(min(ring))
    return tuple(ring[i:] + ring[:i])


def cycle_violations(scan: Scan) -> list[str]:
    """One message per distinct shortest cycle between units, with the import behind each edge."""
    edges, seen, out = unit_edges(scan), set(), []
    for unit in sorted(edges):
        cycle = cycle_through(unit, edges)
        if cycle and canonical(cycle) not in seen:
            seen.add(canonical(cycle))
            evidence = "; ".join(edges[a][b].where() for a, b in pairwise(cycle))
            out.append(f"cycle {' -> '.join(cycle)}: {evidence}")
    return out
