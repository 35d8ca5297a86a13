"""The package's modules import each other without a cycle, counting every import statement.

The graph is read from the source with :mod:`ast`, so an import inside a function or under ``TYPE_CHECKING`` counts
as much as one at the top of a module: a deferred import hides a cycle from Python, not from a reader. Edges:

* ``import a.b.c`` is an edge to ``a.b.c``; ``from a.b import c`` is an edge to ``a.b.c`` when that is a module of the
  package, else to ``a.b`` (the name is read from ``a/b/__init__.py``, or from ``a/b.py``). Relative imports are
  resolved first. Only modules of ``lightning_fastdata`` are kept.
* Python runs a package's ``__init__.py`` before any module in it, so an import of ``a.b.c`` is an edge to the
  package ``a.b`` too: ``device_decode`` importing ``lightning_fastdata.pipeline.streams`` runs
  ``pipeline/__init__.py`` and all it imports.
* Except the packages that contain the importing module (its parent ``__init__``, the parent's parent): Python has
  begun running those before the module itself, so such an import never starts a new import. It reads the names
  the ``__init__`` has bound by then, the same ones whoever imports first, so it cannot depend on import order,
  which is the failure a cycle brings. The top package ``lightning_fastdata`` contains every module, so it is never
  an edge's end.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

PACKAGE = "lightning_fastdata"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def _modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root`` by dotted name (a package by its own name, for its ``__init__.py``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, path: Path, modules: dict[str, Path], shown: str) -> dict[str, str]:
    """The package modules ``name`` imports, each with the place (``shown:line``) of its first import statement."""
    found: dict[str, str] = {}

    def add(target: str, line: int) -> None:
        parts = target.split(".")
        for end in range(1, len(parts) + 1):  # the packages Python runs first, then the module itself
            module = ".".join(parts[:end])
            if module in modules and module != name and not name.startswith(f"{module}."):  # see the module docs
                found.setdefault(module, f"{shown}:{line}")

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name if _is_package(path) else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base, node.lineno)
    return found


def import_graph(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """``{module: {imported module: path:line}}`` for every module of the package at ``root``."""
    modules = _modules(root)
    return {
        name: _imports(name, path, modules, f"{PACKAGE}/{path.relative_to(root).as_posix()}")
        for name, path in modules.items()
    }


def tangles(graph: dict[str, dict[str, str]]) -> list[set[str]]:
    """The strongly connected parts of ``graph`` with more than one module: each module reaches the others (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                part.add(member)
                if member == node:
                    break
            if len(part) > 1:
                parts.append(part)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return parts


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) in each tangle of ``graph``."""
    return [_cycle_in(graph, part) for part in tangles(graph)]


def _cycle_in(graph: dict[str, dict[str, str]], part: set[str]) -> list[str]:
    """A shortest cycle through the first module (by name) of a strongly connected ``part``."""
    start = min(part)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    return [*paths[node], start]
                if target in part and target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(part)}")


def _describe(graph: dict[str, dict[str, str]], part: set[str]) -> str:
    """The modules of a tangle, and one cycle among them with the place of each import."""
    cycle = _cycle_in(graph, part)
    steps = [f"    {a} -> {b}  ({graph[a][b]})" for a, b in itertools.pairwise(cycle)]
    return "\n".join([f"  {', '.join(sorted(part))}, e.g. " + " -> ".join(cycle), *steps])


def test_the_package_has_no_import_cycle():
    """No chain of import statements, deferred ones included, leads from a module of the package back to itself."""
    graph = import_graph()
    parts = tangles(graph)
    assert not parts, "modules that import each other:\n" + "\n".join(_describe(graph, part) for part in parts)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Deferred, relative and ``from package import module`` imports are edges, via the packages Python runs first."""
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (package / "a.py").write_text("def f():\n    from lightning_fastdata.sub import b\n")
    (package / "sub" / "__init__.py").write_text("from .b import B\n")
    (package / "sub" / "b.py").write_text("import lightning_fastdata.c\nfrom lightning_fastdata.sub import B\n")
    (package / "c.py").write_text("from lightning_fastdata.sub import B\nimport os\n")
    graph = import_graph(package)
    assert graph == {
        PACKAGE: {f"{PACKAGE}.a": f"{PACKAGE}/__init__.py:3"},
        f"{PACKAGE}.a": {f"{PACKAGE}.sub": f"{PACKAGE}/a.py:2", f"{PACKAGE}.sub.b": f"{PACKAGE}/a.py:2"},
        f"{PACKAGE}.sub": {f"{PACKAGE}.sub.b": f"{PACKAGE}/sub/__init__.py:1"},
        f"{PACKAGE}.sub.b": {f"{PACKAGE}.c": f"{PACKAGE}/sub/b.py:1"},  # its import of its own package is left out
        f"{PACKAGE}.c": {f"{PACKAGE}.sub": f"{PACKAGE}/c.py:1"},
    }
    assert find_cycles(graph) == [[f"{PACKAGE}.c", f"{PACKAGE}.sub", f"{PACKAGE}.sub.b", f"{PACKAGE}.c"]]
