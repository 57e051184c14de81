"""The kvchat package's modules import each other without a cycle.

Every import counts: top level, inside functions and under ``TYPE_CHECKING``, because a
cycle hidden in any of them still ties the modules together (and a lazy import that
closes a cycle breaks as soon as someone hoists it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvchat

PACKAGE_ROOT = Path(kvchat.__file__).parent
PACKAGE = "kvchat"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _resolve_relative(module: str, level: int, target: str | None, is_pkg: bool) -> str:
    base = module.split(".")
    # A package's own ``from . import x`` is relative to itself, a module's to its parent.
    drop = level - 1 if is_pkg else level
    if drop:
        base = base[:-drop]
    return ".".join(base + ([target] if target else []))


def _imports_of(name: str, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(modules[name].read_text(), filename=str(modules[name]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(name, node.level, node.module, _is_package(name, modules))
            else:
                base = node.module or ""
            # ``from kvchat.x import y`` imports module kvchat.x.y when there is one,
            # else the name y from kvchat.x (a package: its __init__).
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _all_modules()
    return {name: _imports_of(name, modules) for name in modules}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a closed path of module names, or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == GREY:
                return stack[stack.index(nxt) :] + [nxt]
            if colour[nxt] == WHITE and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        colour[node] = BLACK
        return None

    for node in sorted(graph):
        if colour[node] == WHITE and (cycle := visit(node)):
            return cycle
    return None


def test_graph_sees_the_package():
    graph = import_graph()
    assert "kvchat.engine.chat.session" in graph
    assert "kvchat.cli" in graph


def test_finder_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_package_imports_have_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
