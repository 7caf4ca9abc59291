"""The package's import graph has no cycles, counting imports inside functions.

A cycle that only closes through an import inside a function still couples the modules both ways
(one cannot be understood, tested or moved without the other) and fails at import time once
someone moves that import to the top. Imports under ``if TYPE_CHECKING:`` are left out: they never
run, and annotations may name a caller's type.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tiercache
from tiercache.cache import core_of

PACKAGE = Path(tiercache.__file__).resolve().parent


def _modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` (a package is its ``__init__``)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Ids of every node under an ``if TYPE_CHECKING:`` block."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                skip.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skip


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its file (functions included).

    ``from a.b import c`` points at ``a.b.c`` where that is a module, else at ``a.b``; relative
    imports are resolved. Importing ``a.b.c`` also runs ``a/__init__``; that implicit edge is not
    counted (every module would then depend on the package's front door).
    """
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target not in modules:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.add(sub if sub in modules else target)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path_within(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through ``component``, as the import chain to print: ``a -> b -> ... -> a``."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                todo.append(w)
    return component


def test_the_graph_sees_imports_inside_functions_and_skips_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
                                      "def g():\n    from .. import a\n")
    (pkg / "a.py").write_text("import pkg\n")
    (pkg / "c.py").write_text("from pkg.sub.b import g\n")
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.a"}, "pkg.a": {"pkg"},
                     "pkg.c": {"pkg.sub.b"}}
    assert cycles(graph) == [["pkg", "pkg.a", "pkg.sub.b"]]


def test_tiercache_has_no_import_cycles() -> None:
    graph = import_graph(PACKAGE)
    assert "tiercache.cache" in graph and "tiercache.agent.saver" in graph  # the walk found the package
    chains = [" -> ".join(_path_within(graph, c)) for c in cycles(graph)]
    assert chains == [], "import cycles (imports inside functions count):\n" + "\n".join(chains)


#: What belongs to the core, not the facade (docs/design.md section 1, "The facade and the core").
_CORE_ONLY = ("repo", "catalog", "reader", "next_version", "restore_version", "note_restored", "keep_in_ram",
              "meter", "policy", "health")
_INTERNAL = re.compile(rf"\bcache\.({'|'.join(_CORE_ONLY)})\b|\bcache\._core\b")


def test_only_the_facade_reaches_its_core_and_nothing_reaches_internals_through_the_facade() -> None:
    reaches = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "cache.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _INTERNAL.search(re.sub(r"tiercache\.\w+", "", code)):
                reaches.append(f"{rel}:{n}: {line.strip()}")
    assert reaches == [], "use tiercache.cache.core_of(cache) instead:\n" + "\n".join(reaches)


def test_the_facade_answers_nothing_of_its_core(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        assert [name for name in _CORE_ONLY if hasattr(cache, name)] == []
        core = core_of(cache)
        assert [name for name in _CORE_ONLY if not hasattr(core, name)] == ["health"]  # it is the repo's
        assert core.repo.health.available("disk")
