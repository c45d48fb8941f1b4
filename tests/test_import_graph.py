"""The package's modules import each other without a cycle, lazy imports inside functions too.

The graph is read from the source with `ast`, using the package layout pyproject.toml
declares (``kernels/`` installs as ``sglang_bastion.kernels``, and so on). An edge A -> B means
A's source imports B somewhere, at module level or inside a function, so a cycle hidden
behind a function-level import still counts. A module importing its own package (a submodule
importing a sibling) is not an edge: the package's ``__init__`` runs first either way.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the installed package, by dotted name, from pyproject's layout."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setuptools.get("package-dir", {})
    modules = {}
    for package in setuptools["packages"]:
        folder = root / package_dir.get(package, package.replace(".", "/"))
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def imported_names(path: Path, module: str) -> set[str]:
    """Dotted names ``module``'s source imports (``from a import b`` gives a and a.b)."""
    is_package = path.stem == "__init__"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                anchor = parts if is_package else parts[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Edges between package modules; a module's own ancestor packages are left out."""
    graph = {}
    for module, path in modules.items():
        ancestors = {module.rsplit(".", k)[0] for k in range(1, module.count(".") + 1)}
        targets = set()
        for name in imported_names(path, module):
            # Importing a.b.c runs a, a.b and a.b.c: each that is a package module counts.
            parts = name.split(".")
            for k in range(1, len(parts) + 1):
                prefix = ".".join(parts[:k])
                if prefix in modules and prefix != module and prefix not in ancestors:
                    targets.add(prefix)
        graph[module] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a closed list of modules, or None if it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the package's parts: its subpackages and its top-level modules."""

    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])

    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = parts.setdefault(part(module), set())
        edges.update(part(t) for t in targets if part(t) not in (part(module), "sglang_bastion"))
    return parts


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph(package_modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_package_parts_are_layered():
    # e.g. the tree ops may use the kernels' dispatch, and calibration the server's modules,
    # but then neither the kernels nor the server may import back.
    cycle = find_cycle(part_graph(import_graph(package_modules())))
    assert cycle is None, "cycle between parts: " + " -> ".join(cycle)


def test_the_graph_sees_every_layout_package_and_a_lazy_import():
    modules = package_modules()
    assert "sglang_bastion.worker" in modules
    assert "sglang_bastion.kernels" in modules  # kernels/__init__.py, by package-dir
    graph = import_graph(modules)
    # spec_algo imports the profile loader inside a function.
    assert "sglang_bastion.budget" in graph["sglang_bastion.spec_algo"]


@pytest.mark.parametrize(
    ("graph", "cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"a"}}, ["a", "a"]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),  # a diamond is no cycle
    ],
)
def test_find_cycle_finds_exactly_the_cycles(graph, cycle):
    assert find_cycle(graph) == cycle


def test_relative_and_from_imports_resolve_to_modules(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("from . import sibling\nfrom .inner import thing\nimport os.path\n")
    names = imported_names(source, "pkg.sub.mod")
    assert {"pkg.sub", "pkg.sub.sibling", "pkg.sub.inner", "pkg.sub.inner.thing"} <= names
    assert "os.path" in names
