"""The Python code's import graph has no circle, and the layers keep to their rules.

Every ``.py`` under ``jupyter_gpushare/`` and ``bench/`` is parsed with :mod:`ast` (nothing is
imported). Every import counts wherever it stands: at module level, inside a function (a lazy
import that exists only to dodge a circle is still a circle), under ``if TYPE_CHECKING:`` (a
type-only dependency is still a dependency), and ``importlib.import_module("literal")``.
Relative imports are resolved against the importing module's package. ``from P import name``
points at the submodule ``P.name`` when there is one, else at ``P`` itself: a name that a package
``__init__`` re-exports makes the importer depend on that ``__init__`` (and so on everything the
``__init__`` imports).

1. **No circle**: the graph's strongly connected components all have one module. A failure
   prints each circle as a chain of modules with the file and line of every import in it.
   ``ALLOWED_EDGES`` lists the imports still forming circles inside ``jupyter_gpushare/scheduler/``
   (left while that folder is being reorganised); it may only shrink.
2. **Layer rules**: ``LAYER_RULES`` maps a package to the modules that nothing under it may
   import (``forbidden_prefixes``: our own packages; ``forbidden_stdlib``: standard modules that
   do I/O or read a clock). A package that does not exist yet is skipped.

Both checks are also run against small synthetic packages written to ``tmp_path`` so that it is
known they fail when they should.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jupyter_gpushare", "bench")

# Imports that still form circles inside jupyter_gpushare/scheduler/, as (importer, imported).
# They are left alone while scheduler/ is split into core/, shell/ and features/; whoever breaks
# one deletes its line here (whoever moves a module renames it here). The list may only shrink:
# test_allowed_edges_still_exist fails on a line whose import is gone or that closes no circle,
# so a stale line cannot hide a new circle.
ALLOWED_EDGES: frozenset[tuple[str, str]] = frozenset()

# package -> what no module under it may import. A rule for a package that does not exist yet is
# skipped (test_layer_rules), so rules can be written before the code moves.
LAYER_RULES: dict[str, dict[str, list[str]]] = {
    # The pure policy core: events in, decisions out; no I/O, no clock, nothing of the shell.
    "jupyter_gpushare.scheduler.core": {
        "forbidden_prefixes": [
            "jupyter_gpushare.scheduler.shell",
            "jupyter_gpushare.scheduler.features",
            "bench",
        ],
        "forbidden_stdlib": [
            "asyncio",
            "socket",
            "os",
            "time",
            "subprocess",
            "threading",
            "signal",
        ],
    },
}


# ---------------------------------------------------------------------------------------------
# Reading the imports
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """One imported module name, resolved to an absolute dotted name."""

    name: str
    path: Path
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the given top-level folders."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                modules[module_name(path, root)] = path
    return modules


def _base_package(module: str, path: Path, level: int) -> str:
    """The package that a relative import of the given level starts from."""
    parts = module.split(".")
    if path.name != "__init__.py":
        parts.pop()  # a module's package is its parent; a package's is itself
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts)


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every module that ``module`` imports, anywhere in its file, as absolute dotted names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, path, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _base_package(module, path, node.level)
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                # `from P import n` runs the submodule P.n if there is one; else n is a name
                # that P (perhaps a package __init__ re-exporting it) defines
                sub = f"{source}.{alias.name}"
                name = sub if sub in modules else source
                found.append(Import(name, path, node.lineno))
        elif isinstance(node, ast.Call) and _called(node) in ("import_module", "__import__"):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append(Import(first.value, path, node.lineno))
    return found


def _called(call: ast.Call) -> str | None:
    """The name of the called function: ``f`` in ``f(...)`` and ``m.f(...)``."""
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return call.func.id if isinstance(call.func, ast.Name) else None


def _internal_target(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest module of ours that importing ``name`` executes, if any."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


Edges = dict[str, dict[str, Import]]  # importer -> imported -> first import line


def build_graph(root: Path, packages: Iterable[str]) -> Edges:
    """The import graph among the modules under ``packages``."""
    modules = find_modules(root, packages)
    graph: Edges = {name: {} for name in modules}
    for name, path in modules.items():
        for imp in imports_of(name, path, modules):
            target = _internal_target(imp.name, modules)
            if target is not None and target != name:
                graph[name].setdefault(target, imp)
    return graph


def _reachable(edges: dict[str, list[str]], start: str) -> dict[str, str]:
    """Every module that ``start`` reaches, mapped to the one it was first reached from (a
    breadth-first search, so following the map back gives a shortest chain)."""
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in edges[node]:
            if succ not in previous:
                previous[succ] = node
                queue.append(succ)
    return previous


def circles(
    graph: Edges, allowed: frozenset[tuple[str, str]] = frozenset()
) -> list[tuple[list[str], list[str]]]:
    """Each strongly connected component of more than one module (the modules that all reach
    each other), sorted, with a shortest circle through its first module."""
    edges = {a: sorted(b for b in bs if (a, b) not in allowed) for a, bs in graph.items()}
    reach = {name: _reachable(edges, name) for name in edges}
    found = []
    seen: set[str] = set()
    for name in sorted(edges):
        if name in seen or name not in reach[name]:
            continue
        component = sorted(other for other in reach[name] if name in reach[other])
        seen.update(component)
        chain = [name]  # back from `name` to itself along the search's first steps
        while True:
            chain.append(reach[name][chain[-1]])
            if chain[-1] == name:
                break
        found.append((component, chain[::-1]))
    return found


def describe(component: list[str], chain: list[str], graph: Edges, root: Path) -> str:
    lines = [" -> ".join(chain)]
    if len(component) > len(chain) - 1:
        lines.append(f"  (one of the circles among {', '.join(component)})")
    for a, b in itertools.pairwise(chain):
        imp = graph[a][b]
        lines.append(f"    {a} imports {b}  ({imp.path.relative_to(root)}:{imp.line})")
    return "\n".join(lines)


def layer_violations(
    root: Path, packages: Iterable[str], rules: dict[str, dict[str, list[str]]]
) -> tuple[list[str], list[str]]:
    """(rules whose package does not exist, violations as readable lines)."""
    modules = find_modules(root, packages)
    missing: list[str] = []
    violations: list[str] = []
    for package, rule in rules.items():
        folder = root.joinpath(*package.split("."))
        if package not in modules and not folder.is_dir():  # (a folder without __init__ counts)
            missing.append(package)
            continue
        members = {n: p for n, p in modules.items() if n == package or n.startswith(package + ".")}
        forbidden = [*rule.get("forbidden_prefixes", []), *rule.get("forbidden_stdlib", [])]
        for name, path in sorted(members.items()):
            for imp in imports_of(name, path, modules):
                for bad in forbidden:
                    if imp.name == bad or imp.name.startswith(bad + "."):
                        violations.append(
                            f"{name} imports {imp.name} ({path.relative_to(root)}:{imp.line}),"
                            f" which {package} must not import"
                        )
    return missing, sorted(set(violations))


# ---------------------------------------------------------------------------------------------
# The checks on this tree
# ---------------------------------------------------------------------------------------------


def test_no_import_circle() -> None:
    graph = build_graph(ROOT, PACKAGES)
    assert len(graph) > 50, "the modules were not found"
    found = circles(graph, ALLOWED_EDGES)
    assert not found, "import circles (break each through a third module, or turn it around):\n" + (
        "\n".join(describe(component, chain, graph, ROOT) for component, chain in found)
    )


def test_allowed_edges_still_exist() -> None:
    """Each allowed import is still there and still inside jupyter_gpushare/scheduler/: a line
    whose import was fixed, moved or renamed is deleted, not kept as a blank cheque."""
    graph = build_graph(ROOT, PACKAGES)
    for importer, imported in sorted(ALLOWED_EDGES):
        assert importer.startswith("jupyter_gpushare.scheduler."), importer
        assert imported.startswith("jupyter_gpushare.scheduler."), imported
        assert imported in graph.get(importer, {}), (
            f"ALLOWED_EDGES lists {importer} -> {imported}, which no longer exists: delete the"
            " line if the circle is broken, or give the modules' new names if they moved"
        )
    # and each one is needed: allowed no more, it closes a circle
    for importer, imported in sorted(ALLOWED_EDGES):
        found = circles(graph, ALLOWED_EDGES - {(importer, imported)})
        assert any(importer in c and imported in c for c, _ in found), (
            f"{importer} -> {imported} closes no circle: delete it from ALLOWED_EDGES"
        )


@pytest.mark.parametrize("package", sorted(LAYER_RULES))
def test_layer_rules(package: str) -> None:
    missing, violations = layer_violations(ROOT, PACKAGES, {package: LAYER_RULES[package]})
    if missing:
        pytest.skip(f"{package} does not exist yet")
    assert not violations, "\n".join(violations)


# ---------------------------------------------------------------------------------------------
# The checks bite: synthetic packages
# ---------------------------------------------------------------------------------------------


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cycle_finder_sees_every_kind_of_import(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            # lazy, relative: a -> b at module level, b -> a inside a function
            "pkg/__init__.py": "",
            "pkg/a.py": "from . import b\n",
            "pkg/b.py": "def f():\n    from .a import g\n",
            # TYPE_CHECKING only, two levels up
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from ..d import D\n",
            "pkg/d.py": "import pkg.sub.c\n",
            # through a package __init__'s re-export
            "reexp/__init__.py": "from .impl import thing\n",
            "reexp/impl.py": "from .user import use\n",
            "reexp/user.py": "from reexp import thing\n",
            # importlib with a literal
            "dyn/__init__.py": "",
            "dyn/x.py": "import importlib\nimportlib.import_module('dyn.y')\n",
            "dyn/y.py": "from dyn import x\n",
            # no circle: a chain, and a package importing its own submodule
            "fine/__init__.py": "from .one import v\n",
            "fine/one.py": "from . import two\n",
            "fine/two.py": "import os\n",
        },
    )
    graph = build_graph(tmp_path, ["pkg", "reexp", "dyn", "fine"])
    found = [chain for _, chain in circles(graph)]
    assert found == [
        ["dyn.x", "dyn.y", "dyn.x"],
        ["pkg.a", "pkg.b", "pkg.a"],
        ["pkg.d", "pkg.sub.c", "pkg.d"],
        ["reexp", "reexp.impl", "reexp.user", "reexp"],
    ], found
    text = describe(["pkg.a", "pkg.b"], ["pkg.a", "pkg.b", "pkg.a"], graph, tmp_path)
    assert "pkg/b.py:2" in text and "pkg/a.py:1" in text, text
    # an allowed edge takes its circle out, and only that one
    assert len(circles(graph, frozenset({("pkg.b", "pkg.a")}))) == 3


def test_layer_rule_bites(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "app/__init__.py": "",
            "app/core/__init__.py": "",
            "app/core/pure.py": "from dataclasses import dataclass\nfrom . import other\n",
            "app/core/other.py": "def f():\n    from time import monotonic\n",
            "app/core/deep/__init__.py": "",
            "app/core/deep/leaf.py": "from ...shell import server\nimport os.path\n",
            "app/shell/__init__.py": "",
            "app/shell/server.py": "import asyncio\nfrom ..core import pure\n",
            # a namespace package (no __init__.py) is checked too
            "app/extra/thing.py": "import socket\n",
        },
    )
    rules = {
        "app.core": {"forbidden_prefixes": ["app.shell"], "forbidden_stdlib": ["os", "time"]},
        "app.shell": {"forbidden_prefixes": [], "forbidden_stdlib": ["subprocess"]},
        "app.features": {"forbidden_prefixes": ["app.shell"], "forbidden_stdlib": []},
        "app.extra": {"forbidden_prefixes": [], "forbidden_stdlib": ["socket"]},
    }
    missing, violations = layer_violations(tmp_path, ["app"], rules)
    assert missing == ["app.features"]
    joined = "\n".join(violations)
    assert "app.core.other imports time" in joined, joined
    assert "app.core.deep.leaf imports app.shell" in joined, joined
    assert "app.core.deep.leaf imports os.path" in joined, joined
    assert "app.extra.thing imports socket" in joined, joined
    # dataclasses and the core's own modules are fine; the rules for app.shell hold
    assert len(violations) == 4, joined
