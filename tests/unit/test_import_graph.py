"""The import graph of edgeprune, exporters, runtime and devices: no cycle, dependencies one way.

The folders ``exporters/``, ``runtime/`` and ``devices/`` are imported as ``edgeprune_exporters``,
``edgeprune_runtime`` and ``edgeprune_devices`` (pyproject.toml's package-dir); the short folder
names are never import names.

The contract (docs/architecture.md): ``edgeprune -> exporters -> runtime``, ``devices -> runtime``;
``runtime`` imports none of the others, ``exporters`` never imports ``edgeprune``, ``devices``
imports neither ``edgeprune`` nor ``exporters``. Every module found under the four folders is
parsed (``ast``), imports inside functions included (they tie modules together all the same),
so the check follows whatever modules exist as files move.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: folder -> import name
PACKAGES = {"edgeprune": "edgeprune", "exporters": "edgeprune_exporters",
            "runtime": "edgeprune_runtime", "devices": "edgeprune_devices"}

#: package (import name) -> the packages of ours it must never import
FORBIDDEN = {
    "edgeprune_runtime": {"edgeprune", "edgeprune_exporters", "edgeprune_devices"},
    "edgeprune_exporters": {"edgeprune"},
    "edgeprune_devices": {"edgeprune", "edgeprune_exporters"},
}


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under ``root/<folder>`` for each
    ``folder -> import name`` of ``packages`` (a package's ``__init__.py`` is named after it)."""
    mods = {}
    for folder, name in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [name, *path.relative_to(root / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def imported_names(mods: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: every dotted name it imports}`` (see :func:`_imported_names`)."""
    return {m: _imported_names(ast.parse(p.read_text(encoding="utf-8"), filename=str(p)), m,
                               p.name == "__init__.py") for m, p in mods.items()}


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Dotted names imported anywhere in ``tree`` (relative imports resolved); for
    ``from X import y`` both ``X.y`` (a submodule, perhaps) and ``X``."""
    pkg = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def import_edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: modules of ours it imports}``: each imported name mapped to the
    longest module of ``mods`` it names or lies in; a module's own ancestors (packages
    Python initialises before it anyway) and itself are left out."""
    graph = {m: set() for m in mods}
    for m, names in imported_names(mods).items():
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != m and not m.startswith(name + "."):
                graph[m].add(name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` per strongly connected component with more than one
    node (Tarjan's algorithm; iterative), each starting at its smallest module name."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        comps.append(comp)
    return [_cycle_through(min(c), graph, c) for c in sorted(comps, key=min)]


def _cycle_through(start: str, graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """The shortest path ``start -> ... -> start`` inside the component ``comp``."""
    prev = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & comp):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is on no cycle of {sorted(comp)}")


def rule_violations(graph: dict[str, set[str]]) -> list[str]:
    """``"module -> imported module"`` for every import :data:`FORBIDDEN` rules out."""
    out = []
    for m, targets in sorted(graph.items()):
        banned = FORBIDDEN.get(m.split(".")[0], set())
        out += [f"{m} -> {t}" for t in sorted(targets) if t.split(".")[0] in banned]
    return out


# ---------------------------------------------------------------------------- self-tests

def test_cycle_finder_finds_a_planted_cycle_and_nothing_else():
    acyclic = {"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"a"}}
    assert find_cycles(acyclic) == []
    cyclic = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert find_cycles(cyclic) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    # a long chain closing on itself (the iterative search needs no recursion depth)
    chain = {f"m{i:04d}": {f"m{i + 1:04d}"} for i in range(3000)}
    chain["m3000"] = {"m0000"}
    (cyc,) = find_cycles(chain)
    assert len(cyc) == 3002 and cyc[0] == cyc[-1] == "m0000"


def test_edges_resolve_relative_and_function_level_imports(tmp_path):
    """A planted package: relative imports, ``from . import x``, an import inside a
    function and a forbidden import are all seen; ancestors and third-party names are not."""
    files = {
        "runtime/__init__.py": "from .session import load\n",
        "runtime/session.py": "import numpy as np\nfrom . import memory\nfrom .errors import E\n"
                              "def f():\n    from edgeprune_devices.profiler import profile\n",
        "runtime/memory.py": "import edgeprune_runtime\nfrom edgeprune_runtime.errors import E\n",
        "runtime/errors.py": "",
        "devices/__init__.py": "",
        "devices/profiler/__init__.py": "from ..catalog import x\nfrom .run import profile\n",
        "devices/profiler/run.py": "from edgeprune_runtime.session import load\n",
        "devices/catalog.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    mods = module_files(tmp_path, {"runtime": "edgeprune_runtime", "devices": "edgeprune_devices"})
    g = import_edges(mods)
    rt, dv = "edgeprune_runtime", "edgeprune_devices"
    assert g[rt] == {f"{rt}.session"}
    assert g[f"{rt}.session"] == {f"{rt}.memory", f"{rt}.errors", f"{dv}.profiler"}
    assert g[f"{rt}.memory"] == {f"{rt}.errors"}
    assert g[f"{dv}.profiler"] == {f"{dv}.catalog", f"{dv}.profiler.run"}
    assert rule_violations(g) == [f"{rt}.session -> {dv}.profiler"]
    assert find_cycles(g) == [[f"{dv}.profiler", f"{dv}.profiler.run", f"{rt}.session",
                               f"{dv}.profiler"]]


# ---------------------------------------------------------------------------- the tree

@pytest.fixture(scope="module")
def graph():
    mods = module_files(ROOT)
    assert {m.split(".")[0] for m in mods} == set(PACKAGES.values())
    return import_edges(mods)


def test_folder_names_are_never_imported():
    """No module of ours, test or bench imports ``runtime``, ``exporters`` or ``devices`` by
    the folder's short name (those names belong to other distributions on PyPI)."""
    mods = module_files(ROOT)
    for extra in ("tests", "bench"):
        for path in sorted((ROOT / extra).rglob("*.py")):
            mods[f"_{extra}." + ".".join(path.relative_to(ROOT / extra).with_suffix("").parts)] = path
    bad = sorted(f"{m} imports {n}" for m, names in imported_names(mods).items() for n in names
                 if n.split(".")[0] in ("runtime", "exporters", "devices"))
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_modules(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_dependencies_flow_one_way(graph):
    """runtime imports none of edgeprune / exporters / devices; exporters never imports
    edgeprune; devices imports neither edgeprune nor exporters."""
    bad = rule_violations(graph)
    assert not bad, "imports against docs/architecture.md's dependency rule:\n" + "\n".join(bad)
