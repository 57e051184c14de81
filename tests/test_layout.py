"""The package layout of docs/architecture.md holds, read from the source with ``ast``.

Every import counts: module level, inside functions, and under ``TYPE_CHECKING``, since a
lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "kvchat"

# What each part of kvchat may import from the others. A part is a subpackage, or one of
# the top-level modules (cli, errors, paths, threads, units). Lower layers never reach up.
BASE = {"errors", "paths", "threads", "units"}
MAY_IMPORT: dict[str, set[str]] = {
    "kvchat": set(),  # the package's __init__
    "engine": set(),  # kvchat/engine/__init__.py: a docstring, no imports
    "errors": set(),
    "paths": set(),
    "threads": set(),
    "units": set(),
    "storage": BASE,
    "kvdirect": BASE | {"storage"},
    "models": BASE | {"storage", "kvdirect"},
    "chat": BASE | {"storage", "kvdirect", "models"},
    "lab": BASE | {"storage", "kvdirect", "models", "chat"},
    "serve": BASE | {"storage", "kvdirect", "models", "chat"},
    "ui": BASE | {"storage", "kvdirect", "models", "chat"},
    "commands": BASE | {"storage", "kvdirect", "models", "chat", "lab", "serve", "ui"},
    "cli": BASE | {"storage", "kvdirect", "models", "chat", "lab", "serve", "ui", "commands"},
}
# Third-party packages a part must never import, not even lazily.
NEVER_IMPORTS = {"ui": {"torch", "transformers"}}


@dataclass(frozen=True)
class Import:
    where: str  # "kvchat/x/y.py:12"
    module: str  # the module imported from ("kvchat.engine.models.gguf", "torch")
    name: str | None  # the name taken from it (``from module import name``), if any


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str:
    """``kvchat.engine.models.gguf`` -> ``models``; ``kvchat.cli`` -> ``cli``; ``kvchat`` itself.
    The engine's three packages are parts of their own; ``kvchat.engine`` itself is ``engine``."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "engine":
        return parts[2]
    return parts[1] if len(parts) > 1 else parts[0]


@cache
def syntax_tree(path: Path) -> ast.Module:
    """Each source parsed once: every rule below walks the same trees."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@cache
def is_module(dotted: str) -> bool:
    path = PACKAGE_ROOT.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@cache
def imports_of(path: Path) -> tuple[Import, ...]:
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    tree = syntax_tree(path)
    relative = path.relative_to(PACKAGE_ROOT.parent)
    found: list[Import] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        where = f"{relative}:{node.lineno}"
        if isinstance(node, ast.Import):
            found += [Import(where, alias.name, None) for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                # ``from kvchat.engine.models import gguf`` imports that module.
                if is_module(f"{base}.{alias.name}"):
                    found.append(Import(where, f"{base}.{alias.name}", None))
                else:
                    found.append(Import(where, base, alias.name))
    return tuple(found)


def private_attribute_uses(path: Path) -> list[str]:
    """``module._name`` where ``module`` is a kvchat module this file imported."""
    tree = syntax_tree(path)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvchat") and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvchat"):
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                if is_module(dotted):
                    aliases[alias.asname or alias.name] = dotted
    uses = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and is_private(node.attr)
        ):
            where = f"{path.relative_to(PACKAGE_ROOT.parent)}:{node.lineno}"
            uses.append(f"{where}: {aliases[node.value.id]}.{node.attr}")
    return uses


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


SOURCES = sorted(PACKAGE_ROOT.rglob("*.py"))


def test_the_layout_is_the_documented_one():
    parts = {part_of(module_name(p)) for p in SOURCES}
    engine = sorted(p.name for p in (PACKAGE_ROOT / "engine").iterdir() if p.is_dir())
    assert [e for e in engine if e != "__pycache__"] == ["chat", "kvdirect", "models"]
    assert not {"chat", "models", "kvdirect"} & {p.name for p in PACKAGE_ROOT.iterdir()}
    assert parts <= set(MAY_IMPORT), f"add {parts - set(MAY_IMPORT)} to MAY_IMPORT and the doc"


def test_no_module_imports_another_modules_private_names():
    offenders = []
    for path in SOURCES:
        for imp in imports_of(path):
            if imp.module.startswith("kvchat") and imp.name is not None and is_private(imp.name):
                offenders.append(f"{imp.where}: from {imp.module} import {imp.name}")
            elif imp.module.startswith("kvchat") and any(
                is_private(piece) for piece in imp.module.split(".")
            ):
                offenders.append(f"{imp.where}: import {imp.module}")
        offenders += private_attribute_uses(path)
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("part", sorted(MAY_IMPORT))
def test_imports_flow_one_way(part: str):
    offenders = []
    for path in SOURCES:
        if part_of(module_name(path)) != part:
            continue
        for imp in imports_of(path):
            top = imp.module.split(".")[0]
            if top == "kvchat":
                target = part_of(imp.module)
                if target != part and target not in MAY_IMPORT[part]:
                    offenders.append(f"{imp.where}: {part} imports {imp.module}")
            elif top in NEVER_IMPORTS.get(part, set()):
                offenders.append(f"{imp.where}: {part} imports {imp.module}")
    assert not offenders, "\n".join(offenders)


def test_the_checker_sees_lazy_and_type_checking_imports():
    """The rules above are only as good as the parser: it must see every kind of import."""
    source = (
        PACKAGE_ROOT / "engine" / "kvdirect" / "cache.py"
    )  # TYPE_CHECKING and in-function imports
    text = source.read_text(encoding="utf-8")
    assert "if TYPE_CHECKING:" in text
    seen = {imp.module for imp in imports_of(source)}
    assert "kvchat.engine.kvdirect.arch" in seen  # only under TYPE_CHECKING there
    assert "kvchat.engine.kvdirect.attention" in seen  # only inside functions there
