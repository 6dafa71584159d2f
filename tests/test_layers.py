"""The package's layering rules, checked on a static scan of every import in src/tierserve (see
helpers/import_graph.py), a runtime check that the torch-free entry points really stay torch-free, and
a check that no test reads outside the repository (helpers/outside_paths.py).

The rules (the tables below hold what they allow and forbid; docs/architecture.md, Layering, states them):
1. prefill_node and decode_node never import each other.
2. router, bench, api, core and launch never import torch or mooncake, directly or through other modules.
3. Every unit imports from tierserve only itself and its row of ALLOWED.
4. cache never imports the serving layers above it (CACHE_MUST_NOT_IMPORT).
5. No import cycles between the top-level packages/modules of tierserve.
6. Every unit has a row in ALLOWED: a new package is placed in a layer when it is added.
7. No test names a place outside the repository (helpers/outside_paths.py states the rule).
The second half of the file shows that each check fires on a small fixture that breaks it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.import_graph import (
    Scan,
    allowlist_violations,
    cycle_violations,
    forbidden_violations,
    heavy_import_violations,
    scan,
    unplaced_violations,
)
from helpers.outside_paths import outside_paths

# Besides itself, what each unit may import from tierserve: units or dotted sub-names (relative to
# tierserve). Rows: the serving stack from the bottom up, then the torch-free client side, then the
# entry points. A unit is a top-level package or module; "__init__" is the package itself.
NODE_MAY_IMPORT = ("core", "proto", "model", "cache", "engine", "transfer", "tracing",
                   "api.engine_metrics")  # the Prometheus view of an engine's stats, torch-free
# A role reaches the model and the API only through node.
ROLE_MAY_IMPORT = ("core", "proto", "cache", "engine", "transfer", "node", "tracing")
ALLOWED: dict[str, tuple[str, ...]] = {
    "__init__": (),
    "core": (),
    "mooncake_env": ("core",),
    "proto": ("core",),
    "model": ("core",),
    "cache": ("core", "mooncake_env"),
    "engine": ("core", "model", "cache", "structured"),
    "structured": ("core",),  # llguidance grammars: torch-free, shared by the API's checks and the engine
    "tracing": ("core",),  # OpenTelemetry spans (the SDK only with tracing on): every serving role's
    "transfer": ("core", "mooncake_env", "model", "cache", "engine"),
    "node": NODE_MAY_IMPORT,
    "prefill_node": ROLE_MAY_IMPORT,
    "decode_node": ROLE_MAY_IMPORT,
    "bench": ("core",),
    "api": ("core", "proto", "structured", "tracing", "cache.hashing", "cache.events"),
    "router": ("core", "api", "proto", "tracing", "cache.hashing", "cache.events"),
    "launch": ("core",),  # `tierserve up` starts the other parts as processes, never imports them
    "cli": ("core", "mooncake_env", "proto", "model", "cache", "engine", "structured", "transfer", "node",
            "prefill_node", "decode_node", "bench", "api", "router", "launch", "tracing"),
}
TORCH_FREE = ("core", "structured", "tracing", "bench", "api", "router", "launch")
HEAVY = ("torch", "mooncake")  # top-level names the torch-free units must never reach
SIBLINGS = {"prefill_node": ("decode_node",), "decode_node": ("prefill_node",)}
CACHE_MUST_NOT_IMPORT = ("engine", "node", "prefill_node", "decode_node", "router", "api", "cli")
# Imported in a fresh interpreter, each must leave torch and mooncake unloaded (the console script
# too: every command's parser is built before any command runs).
RUNTIME_TORCH_FREE = ("tierserve.router.app", "tierserve.api.app", "tierserve.api.engine_backend",
                      "tierserve.cli.main", "tierserve.bench.runner", "tierserve.launch.run", "tierserve.tracing.otel")

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "tierserve"


def check_siblings(tree: Scan) -> list[str]:
    """Rule 1 on ``tree``."""
    return [msg for unit, other in SIBLINGS.items() for msg in forbidden_violations(tree, unit, other)]


def check_heavy(tree: Scan) -> list[str]:
    """Rule 2 on ``tree``."""
    return heavy_import_violations(tree, TORCH_FREE, HEAVY)


def check_allowed(tree: Scan) -> list[str]:
    """Rule 3 on ``tree``."""
    return allowlist_violations(tree, ALLOWED)


def check_cache(tree: Scan) -> list[str]:
    """Rule 4 on ``tree``."""
    return forbidden_violations(tree, "cache", CACHE_MUST_NOT_IMPORT)


def check_placed(tree: Scan) -> list[str]:
    """Rule 6 on ``tree``."""
    return unplaced_violations(tree, ALLOWED)


RULES = {
    "siblings": check_siblings,
    "no_torch": check_heavy,
    "allow_list": check_allowed,
    "cache_below_serving": check_cache,
    "no_cycles": cycle_violations,
    "every_unit_placed": check_placed,
}


@pytest.fixture(scope="module")
def real_tree() -> Scan:
    return scan(REPO / "src" / PACKAGE, PACKAGE, shown_from=REPO)


@pytest.mark.parametrize("rule", list(RULES))
def test_layering_rule_holds_on_the_real_tree(real_tree: Scan, rule: str) -> None:
    violations = RULES[rule](real_tree)
    assert not violations, f"{len(violations)} violation(s) of {rule}:\n" + "\n".join(violations)


def test_the_real_tree_is_scanned(real_tree: Scan) -> None:
    assert {"tierserve", "tierserve.router.app"} <= real_tree.modules
    assert any(imp.target.startswith("tierserve.") for imp in real_tree.imports)


PROBE = """
import importlib, sys
importlib.import_module(sys.argv[1])
print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "mooncake"))) or "CLEAN")
"""


@pytest.mark.parametrize("module", RUNTIME_TORCH_FREE)
def test_torch_free_entry_points_load_neither_torch_nor_mooncake(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, f"importing {module} failed:\n{done.stderr}"
    assert done.stdout.strip() == "CLEAN", f"importing {module} loads {done.stdout.strip()}"


# --- the scanner itself, on fixture packages ---------------------------------------------------


def make_tree(root: Path, files: dict[str, str]) -> Scan:
    """Write ``files`` (paths relative to the package ``pkg``) under ``root``/pkg and scan it; every
    package directory gets an empty ``__init__.py`` unless ``files`` gives one."""
    pkg = root / "pkg"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    for folder in [pkg, *(p for p in pkg.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    return scan(pkg, "pkg")


def run_rules(tree: Scan) -> dict[str, list[str]]:
    """Every rule's violations on ``tree``, by rule name."""
    return {name: check(tree) for name, check in RULES.items()}


# A fixture package that follows every rule: the baseline each breaking fixture adds to. (Its
# prefill_node stays over engine alone: the cycle fixtures below expect one way from launch to cache.)
CLEAN = {
    "core/shapes.py": "import dataclasses\n",
    "api/app.py": "from pkg.core import shapes\nfrom ..cache import hashing\n",
    "router/app.py": "from pkg.api.app import x\nfrom pkg.cache.events import Event\nfrom . import policies\n",
    "router/policies.py": "import random\n",
    "bench/cli.py": "import pkg.core.shapes\n",
    "cache/hashing.py": "import hashlib\n",
    "cache/events.py": "from pkg.cache import hashing\n",
    "cache/storage/file.py": "from ..hashing import h\nfrom pkg.core.shapes import S\n",
    "engine/loop.py": "import torch\nfrom pkg.cache import storage\nfrom pkg.cache.storage import file\n",
    "prefill_node/service.py": "from pkg.engine import loop\n",
    "decode_node/service.py": "from pkg.engine.loop import run\n",
    "launch.py": "from pkg.core import shapes\n",
    "mooncake_env.py": "import os\nfrom pkg.core.shapes import S\n",
    "proto/stubs.py": "import grpc\nfrom pkg.core import shapes\n",
    "model/layers.py": "import torch\nfrom pkg.core.shapes import S\n",
    "engine/runner.py": "from pkg.model import layers\nfrom pkg.cache.hashing import h\n",
    "transfer/handoff.py": "from pkg import mooncake_env\nfrom pkg.engine.runner import R\n"
                           "from pkg.model import layers\n",
    "api/engine_metrics.py": "import prometheus_client\n",
    "node/server.py": "from pkg.transfer import handoff\nfrom pkg.proto import stubs\n"
                      "from pkg.api import engine_metrics\n",
    "decode_node/receive.py": "from pkg.node.server import serve\nfrom pkg.transfer.handoff import KV\n",
    "cli/main.py": "import pkg.prefill_node.service\nimport pkg.decode_node.service\nfrom pkg import launch\n",
}


def test_a_tree_that_follows_the_rules_passes(tmp_path: Path) -> None:
    assert run_rules(make_tree(tmp_path, CLEAN)) == {name: [] for name in RULES}


def test_relative_and_from_imports_resolve_to_submodules(tmp_path: Path) -> None:
    tree = make_tree(tmp_path, CLEAN)
    by_module = {(imp.module, imp.target) for imp in tree.imports}
    assert ("pkg.api.app", "pkg.cache.hashing") in by_module  # from ..cache import hashing
    assert ("pkg.router.app", "pkg.router.policies") in by_module  # from . import policies
    assert ("pkg.engine.loop", "pkg.cache.storage") in by_module  # a subpackage
    assert ("pkg.cache.storage.file", "pkg.cache.hashing") in by_module  # from ..hashing import h
    assert ("pkg.router.app", "pkg.api.app") in by_module  # from pkg.api.app import x: a name, not a module


def test_siblings_rule_fires(tmp_path: Path) -> None:
    tree = make_tree(tmp_path, {**CLEAN, "decode_node/service.py": "from pkg.prefill_node import service\n"})
    assert check_siblings(tree) == [
        "pkg/decode_node/service.py:1 imports pkg.prefill_node.service (decode_node must not import prefill_node)"
    ]


def test_an_import_inside_a_function_counts(tmp_path: Path) -> None:
    body = """\
        def start():
            if True:
                from ..decode_node.service import Decoder
            return Decoder
        """
    tree = make_tree(tmp_path, {**CLEAN, "prefill_node/service.py": body})
    assert check_siblings(tree) == [
        "pkg/prefill_node/service.py:3 imports pkg.decode_node.service (prefill_node must not import decode_node)"
    ]


def test_a_direct_torch_import_fires(tmp_path: Path) -> None:
    tree = make_tree(tmp_path, {**CLEAN, "core/shapes.py": "import torch.nn\n"})
    assert "pkg/core/shapes.py:1 imports torch.nn, which leads to torch: core.shapes -> torch" in check_heavy(tree)


def test_a_transitive_torch_import_through_two_modules_fires(tmp_path: Path) -> None:
    files = {**CLEAN, "api/tokenizer.py": "from pkg.model import weights\n",
             "model/weights.py": "from .tensors import T\n", "model/tensors.py": "from torch import Tensor\n",
             "router/app.py": CLEAN["router/app.py"] + "\n\nfrom pkg.api.tokenizer import Tok\n"}
    violations = check_heavy(make_tree(tmp_path, files))
    assert ("pkg/router/app.py:6 imports pkg.api.tokenizer, which leads to torch: "
            "router.app -> api.tokenizer -> model.weights -> model.tensors -> torch") in violations
    assert any(v.startswith("pkg/api/tokenizer.py:1 imports pkg.model.weights,") for v in violations)


def test_mooncake_reached_through_a_package_init_fires(tmp_path: Path) -> None:
    files = {**CLEAN, "cache/__init__.py": "from .store import Store\n", "cache/store.py": "import mooncake.store\n"}
    violations = check_heavy(make_tree(tmp_path, files))
    assert ("pkg/router/app.py:2 imports pkg.cache.events, which leads to mooncake: "
            "router.app -> cache -> cache.store -> mooncake") in violations


def test_imports_under_type_checking_do_not_count(tmp_path: Path) -> None:
    body = """\
        from __future__ import annotations
        import typing
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            import torch
            from pkg.engine.loop import Engine
        if typing.TYPE_CHECKING:
            from pkg.decode_node import service
        else:
            from pkg.core import shapes
        """
    tree = make_tree(tmp_path, {**CLEAN, "router/app.py": body, "prefill_node/service.py": body})
    assert run_rules(tree) == {name: [] for name in RULES}
    assert ("pkg.router.app", "pkg.core.shapes") in {(i.module, i.target) for i in tree.imports}  # the else runs


def test_allow_list_fires(tmp_path: Path) -> None:
    files = {**CLEAN, "router/app.py": CLEAN["router/app.py"] + "from pkg.cache import radix\n",
             "cache/radix.py": "", "bench/cli.py": "from ..api import app\n", "core/shapes.py": "import pkg\n"}
    assert sorted(check_allowed(make_tree(tmp_path, files))) == [
        "pkg/bench/cli.py:1 imports pkg.api.app (bench may import only core)",
        "pkg/core/shapes.py:1 imports pkg (core may import only core)",
        "pkg/router/app.py:4 imports pkg.cache.radix "
        "(router may import only core, api, proto, tracing, cache.hashing, cache.events)",
    ]


def test_cache_rule_fires(tmp_path: Path) -> None:
    files = {**CLEAN, "cache/storage/file.py": "def f():\n    import pkg.engine.loop\n    from pkg.api import app\n"}
    assert check_cache(make_tree(tmp_path, files)) == [
        "pkg/cache/storage/file.py:2 imports pkg.engine.loop (cache must not import engine)",
        "pkg/cache/storage/file.py:3 imports pkg.api.app (cache must not import api)",
    ]


def test_a_cycle_between_units_fires(tmp_path: Path) -> None:
    files = {**CLEAN, "cache/hooks.py": "def later():\n    from pkg import launch\n",
             "launch.py": "import pkg.prefill_node.service\n"}
    assert cycle_violations(make_tree(tmp_path, files)) == [
        "cycle cache -> launch -> prefill_node -> engine -> cache: "
        "pkg/cache/hooks.py:2 imports pkg.launch; pkg/launch.py:1 imports pkg.prefill_node.service; "
        "pkg/prefill_node/service.py:1 imports pkg.engine.loop; pkg/engine/loop.py:2 imports pkg.cache.storage"
    ]


def test_a_two_unit_cycle_is_reported_once(tmp_path: Path) -> None:
    files = {**CLEAN, "core/shapes.py": "from pkg.bench import cli\n"}
    assert cycle_violations(make_tree(tmp_path, files)) == [
        "cycle bench -> core -> bench: "
        "pkg/bench/cli.py:1 imports pkg.core.shapes; pkg/core/shapes.py:1 imports pkg.bench.cli"
    ]


# Rule 3 on the rows beyond the torch-free units: one import each row forbids, and its message.
ROW_BREAKS = {
    "model": ("model/layers.py", "import torch\nfrom pkg.engine import loop\n",
              "pkg/model/layers.py:2 imports pkg.engine.loop (model may import only core)"),
    "engine": ("engine/runner.py", "from pkg.transfer import handoff\n",
               "pkg/engine/runner.py:1 imports pkg.transfer.handoff (engine may import only core, model, cache, "
               "structured)"),
    "transfer": ("transfer/handoff.py", "from pkg.node.server import serve\n",
                 "pkg/transfer/handoff.py:1 imports pkg.node.server "
                 "(transfer may import only core, mooncake_env, model, cache, engine)"),
    "node": ("node/server.py", "from pkg.api.app import create_app\n",  # api.engine_metrics only
             "pkg/node/server.py:1 imports pkg.api.app "
             "(node may import only core, proto, model, cache, engine, transfer, tracing, api.engine_metrics)"),
    "prefill_node": ("prefill_node/service.py", "from pkg.router import app\n",
                     "pkg/prefill_node/service.py:1 imports pkg.router.app (prefill_node may import only "
                     "core, proto, cache, engine, transfer, node, tracing)"),
    "decode_node": ("decode_node/service.py", "import pkg.cli.main\n",
                    "pkg/decode_node/service.py:1 imports pkg.cli.main (decode_node may import only "
                    "core, proto, cache, engine, transfer, node, tracing)"),
    "tracing": ("tracing/spans.py", "from pkg.engine import loop\n",
                "pkg/tracing/spans.py:1 imports pkg.engine.loop (tracing may import only core)"),
    "launch": ("launch.py", "from pkg.engine import loop\n",
               "pkg/launch.py:1 imports pkg.engine.loop (launch may import only core)"),
    "cache": ("cache/hashing.py", "from pkg.model import layers\n",
              "pkg/cache/hashing.py:1 imports pkg.model.layers (cache may import only core, mooncake_env)"),
    "proto": ("proto/stubs.py", "from pkg.cache import hashing\n",
              "pkg/proto/stubs.py:1 imports pkg.cache.hashing (proto may import only core)"),
    "mooncake_env": ("mooncake_env.py", "from pkg.cache import events\n",
                     "pkg/mooncake_env.py:1 imports pkg.cache.events (mooncake_env may import only core)"),
    "__init__": ("__init__.py", "from pkg.core import shapes\n",
                 "pkg/__init__.py:1 imports pkg.core.shapes (__init__ may import only __init__)"),
}


@pytest.mark.parametrize("unit", list(ROW_BREAKS))
def test_each_allow_list_row_fires(tmp_path: Path, unit: str) -> None:
    path, text, message = ROW_BREAKS[unit]
    assert check_allowed(make_tree(tmp_path, {**CLEAN, path: text})) == [message]


def test_a_unit_without_a_row_fires_and_cli_may_not_import_it(tmp_path: Path) -> None:
    files = {**CLEAN, "plugins/extra.py": "", "cli/main.py": CLEAN["cli/main.py"] + "from pkg.plugins import extra\n"}
    tree = make_tree(tmp_path, files)
    assert check_placed(tree) == ["pkg.plugins has no row in the layering table (give it one)"]
    assert check_allowed(tree) == [
        "pkg/cli/main.py:4 imports pkg.plugins.extra (cli may import only core, mooncake_env, proto, model, cache, "
        "engine, structured, transfer, node, prefill_node, decode_node, bench, api, router, launch, tracing)"
    ]


def test_launch_importing_torch_fires(tmp_path: Path) -> None:
    tree = make_tree(tmp_path, {**CLEAN, "launch.py": "import torch\n"})
    assert check_heavy(tree) == ["pkg/launch.py:1 imports torch, which leads to torch: launch -> torch"]


def test_no_test_names_a_place_outside_the_repository() -> None:
    """So that a clone of the repository alone passes: helpers/outside_paths.py states the rule."""
    found = outside_paths(REPO, "tests")
    assert not found, f"{len(found)} place(s) outside the repository:\n" + "\n".join(found)


OUTSIDE = """\
    \"\"\"Reads ../beside/traces and /srv/beside in prose: a docstring, not a path.\"\"\"
    import os
    from pathlib import Path

    HERE = Path(__file__).resolve().parent
    ROOT = HERE.parent
    DATA = HERE / "data" / "traces"
    BESIDE = Path(__file__).resolve().parents[2] / "beside" / "traces"
    ABOVE = ROOT.parent
    SIBLING = Path("../beside/traces/x.jsonl")
    SRV = "/srv/beside/traces"
    SCRATCH = Path("/tmp/up.json"), Path("/proc/self/stat"), "/v1/models"
    CACHE = Path.home() / ".cache" / "tierserve" / "models"
    SSH = Path.home() / ".ssh"
    CONFIG = os.path.expanduser("~/.config/x"), "~/.cache/tierserve/models"
    USER = os.environ["HOME"]
    """
OUTSIDE_HELPER = """\
    from pathlib import Path

    ROOT = Path(__file__).parents[2]
    UP = Path(__file__).parent.parent.parent.parent
    """


def test_the_outside_paths_check_fires(tmp_path: Path) -> None:
    (tmp_path / "tests" / "helpers").mkdir(parents=True)
    (tmp_path / "tests" / "test_x.py").write_text(textwrap.dedent(OUTSIDE), encoding="utf-8")
    (tmp_path / "tests" / "helpers" / "h.py").write_text(textwrap.dedent(OUTSIDE_HELPER), encoding="utf-8")
    assert outside_paths(tmp_path, "tests") == [
        "tests/helpers/h.py:4 climbs from __file__ out of the repository, to ..",
        "tests/test_x.py:8 climbs from __file__ out of the repository, to ../beside/traces",
        "tests/test_x.py:9 climbs from __file__ out of the repository, to ..",
        "tests/test_x.py:10 names '../beside/traces/x.jsonl', a path that climbs with '..'",
        "tests/test_x.py:11 names '/srv/beside/traces', an absolute path outside the repository",
        "tests/test_x.py:14 reads the home folder (Path.home()), other than ~/.cache/tierserve",
        "tests/test_x.py:15 names '~/.config/x', the home folder, other than ~/.cache/tierserve",
        "tests/test_x.py:16 reads HOME from the environment",
    ]


def test_the_readme_layout_names_every_top_level_part() -> None:
    """The README's layout block lists each package and module directly under src/tierserve."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme.split("## Layout", 1)[1].split("```")[1]
    root = REPO / "src" / PACKAGE
    parts = [f"{p.name}/" for p in root.iterdir() if (p / "__init__.py").is_file()]
    parts += [p.name for p in root.glob("*.py") if p.name != "__init__.py"]
    missing = [part for part in sorted(parts) if f"  {part}" not in block]
    assert not missing, f"README.md's layout section does not list {missing}"


# --- the docs name only what the code has ------------------------------------------------------
# Every backticked code name in docs/*.md and README.md (class, member, function, module, path, flag:
# tests/helpers/doc_names.py says what counts) must still exist in the code.

# Names the docs may use that the code does not spell out, each with why.
DOC_NAMES_ALLOWED: dict[str, str] = {
    "tierserve.v1": "the gRPC package declared in tierserve.proto, not a Python module",
    "mooncake/": "the Python package Mooncake's wheels install (docs/mooncake.md)",
    "bin/": "the virtualenv's folder of executables (docs/mooncake.md)",
    "MC_LOG_DIR": "a Mooncake setting the code must not set: it crashes the import (docs/mooncake.md)",
    "health_check": "a Mooncake store method tierserve does not call (docs/mooncake.md)",
    "transfer_check_status": "a Mooncake Transfer Engine method tierserve does not call (docs/mooncake.md)",
    "TransferNotify": "a Mooncake Transfer Engine feature tierserve does not use (docs/mooncake.md)",
    "OTEL_BSP_MAX_QUEUE_SIZE": "an OpenTelemetry SDK setting tierserve leaves to the operator (docs/tracing.md)",
    "OTEL_EXPORTER_OTLP_HEADERS": "an OpenTelemetry SDK setting tierserve leaves to the operator (docs/tracing.md)",
}


def doc_pages() -> list[Path]:
    return [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]


def test_every_code_name_in_the_docs_exists() -> None:
    from helpers.doc_names import stale_names

    stale = stale_names(REPO, doc_pages(), DOC_NAMES_ALLOWED)
    assert not stale, f"{len(stale)} stale name(s) in the docs:\n" + "\n".join(stale)


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text), encoding="utf-8")


# A fixture repository: code with one class, one module function, one flag; docs naming each of them.
DOC_CODE = {
    "src/pkg/__init__.py": "",
    "src/pkg/engine.py": """\
        import argparse

        LIMIT = 3
        SPAN = "pkg.step.queue"


        class Base:
            def step(self) -> None:
                self.ticks = 0


        class Engine(Base):
            retries: int = 0

            def add_request(self) -> None:
                pending = 1
                return pending


        def build_parser() -> argparse.ArgumentParser:
            p = argparse.ArgumentParser()
            p.add_argument("--page-size")
            for role in ("prefill", "decode"):
                p.add_argument(f"--{role}-args")
            return p
        """,
    "src/pkg/sub/gather.py": "def gather(): ...\n",
}
GOOD_DOC = """\
    # Page
    `Engine`, `Engine.add_request`, `Engine.step()` (a base's), `Engine.ticks`, `Engine.retries`, `pkg.engine.LIMIT`,
    `engine.build_parser`, `src/pkg/engine.py`, `sub/gather.py`, `gather.py`, `src/pkg/`, `--page-size 16`,
    `--decode-args`, `tierserve_engine_retries_total{role}`, plain words `like this`, `{"json": 1}`, `/v1/route`,
    `--hicache-*`, `0.5`, the span `pkg.step.queue`.

    ```bash
    tierserve --gone-in-a-fence `Gone`
    ```
    """


def test_good_doc_names_are_not_reported(tmp_path: Path) -> None:
    from helpers.doc_names import stale_names

    write_tree(tmp_path, {**DOC_CODE, "docs/page.md": GOOD_DOC})
    assert stale_names(tmp_path, [tmp_path / "docs" / "page.md"]) == []


def test_stale_doc_names_are_reported(tmp_path: Path) -> None:
    from helpers.doc_names import stale_names

    stale_doc = """\
        The engine appends through `Engine._append`, aborts with `_Abort`, keeps `Engine.pending` (a local),
        lives in `pkg.engine.Gone` and `src/pkg/old.py`, gathers in `cp_gather.py`, takes `--old-flag 2`
        and counts `tierserve_engine_vanished_total`; `Allowed.name` is allowed; a span `pkg.step.gone`.
        """
    write_tree(tmp_path, {**DOC_CODE, "docs/page.md": stale_doc})
    assert stale_names(tmp_path, [tmp_path / "docs" / "page.md"], {"Allowed.name": "a test says so"}) == [
        "docs/page.md:1: `Engine._append` (class Engine has no _append)",
        "docs/page.md:1: `_Abort` (not in the code)",
        "docs/page.md:1: `Engine.pending` (class Engine has no pending)",
        "docs/page.md:2: `pkg.engine.Gone` (module pkg.engine has no Gone)",
        "docs/page.md:2: `src/pkg/old.py` (no such file or folder)",
        "docs/page.md:2: `cp_gather.py` (no such file or folder)",
        "docs/page.md:2: `--old-flag` (no such flag in the code)",
        "docs/page.md:3: `tierserve_engine_vanished_total` (not in the code)",
        "docs/page.md:3: `pkg.step.gone` (no gone in the code)",
    ]
