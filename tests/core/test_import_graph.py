"""The import graph of `dsv4flash`: no circle, no runtime module importing dev tooling, integrations never
importing the service.

The graph is read statically (every module's AST, nothing imported): an `import` anywhere in a module counts,
at module level or inside a function, since a function-level import is the same dependency deferred (the usual
way a circle is hidden). `from pkg import name` is an arrow to the submodule `pkg.name` when there is one, else
to `pkg` itself; the implicit import of a module's parent packages is not an arrow. The `_upstream/` trees of the twins are
upstream source files installed into the upstream package, not dsv4flash modules, and are not read. `DSV4FLASH_GRAPH_ROOT`
points the test at another checkout (e.g. `DSV4FLASH_GRAPH_ROOT=/path/to/other/tree`).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("DSV4FLASH_GRAPH_ROOT") or Path(__file__).resolve().parents[2])
# Dev tooling: the patch-series tooling (and its command line), the benchmarks, the tests.
DEV_TOOLING = ("dsv4flash.patchseries", "dsv4flash.bench", "dsv4flash.cli.patches", "tests")


def _is_under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((root / "dsv4flash").rglob("*.py")):
        if "_upstream" in path.parts:
            continue  # upstream files a twin installs into its upstream package: they are upstream modules there
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The module names one import statement reaches (absolute, before mapping to known modules)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
    return subs + ([target] if len(subs) < len(node.names) else [])


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the dsv4flash modules (and `tests…` names) it imports anywhere in its body."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(module, path, node, modules):
                if _is_under(target, ("tests",)):
                    edges.add(target)
                    continue
                while target and target not in modules:  # `import a.b.name` of a non-module name: its module
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _cycle_path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One loop through a circle, `a -> b -> … -> a`, to name what ties it."""
    members, start = set(component), component[0]
    path, seen, node = [start], {start}, start
    while True:
        nxt = sorted(graph[node] & members)
        back = [n for n in nxt if n in seen]
        node = back[0] if back else nxt[0]
        path.append(node)
        if node in seen:
            return " -> ".join(path[path.index(node):])
        seen.add(node)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    assert (ROOT / "dsv4flash" / "__init__.py").is_file(), f"DSV4FLASH_GRAPH_ROOT={ROOT}: no dsv4flash package there"
    return import_graph(ROOT)


def test_reader_counts_every_kind_of_import(tmp_path):
    files = {
        "dsv4flash/__init__.py": "",
        "dsv4flash/a.py": "import dsv4flash.b\n",
        "dsv4flash/b.py": "def f():\n    from dsv4flash.pkg import c\n",  # function level, a submodule
        "dsv4flash/pkg/__init__.py": "from .c import NAME\n",  # relative, a name of a module
        "dsv4flash/pkg/c.py": "from dsv4flash import a\nNAME = 1\n",
        "dsv4flash/d.py": "from dsv4flash.pkg import NAME\nimport tests.helpers\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    g = import_graph(tmp_path)
    assert g["dsv4flash.a"] == {"dsv4flash.b"} and g["dsv4flash.b"] == {"dsv4flash.pkg.c"}
    assert g["dsv4flash.pkg"] == {"dsv4flash.pkg.c"} and g["dsv4flash.pkg.c"] == {"dsv4flash.a"}
    assert g["dsv4flash.d"] == {"dsv4flash.pkg", "tests.helpers"}
    assert circles(g) == [["dsv4flash.a", "dsv4flash.b", "dsv4flash.pkg.c"]]
    assert _cycle_path(g, circles(g)[0]) == "dsv4flash.a -> dsv4flash.b -> dsv4flash.pkg.c -> dsv4flash.a"


def test_graph_sees_the_package(graph):
    assert len(graph) > 200
    assert "dsv4flash.config" in graph["dsv4flash.model.transformer"]  # module level
    assert "dsv4flash.config" in graph["dsv4flash.train.preflight"]  # function level


def test_no_import_circle(graph):
    found = [_cycle_path(graph, c) for c in circles(graph)]
    assert not found, "import circles:\n" + "\n".join(found)


def test_runtime_never_imports_dev_tooling(graph):
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items() if not _is_under(m, DEV_TOOLING)
                 for t in targets if _is_under(t, DEV_TOOLING))
    assert not bad, "runtime modules importing dev tooling:\n" + "\n".join(bad)


def test_integrations_never_import_the_service(graph):
    found = {f"{m} -> {t}" for m, targets in graph.items() if _is_under(m, ("dsv4flash.integrations",))
             for t in targets if _is_under(t, ("dsv4flash.service",))}
    assert not found, "integrations importing dsv4flash.service:\n" + "\n".join(sorted(found))
