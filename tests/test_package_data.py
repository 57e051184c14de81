"""Every file kvchat reads from its own package at run time ships in the wheel.

A non-editable install (``pip install .``, a wheel) holds only the Python modules and the
``package-data`` globs of pyproject.toml. A C source or header left out builds nothing on
the user's machine, and the kernel it serves silently falls back to slower code."""

from __future__ import annotations

import sys
from fnmatch import fnmatch
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvchat"


def shipped_globs() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-data"]["kvchat"]


def test_every_file_beside_the_modules_is_package_data():
    globs = shipped_globs()
    data = [
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_file() and p.suffix not in {".py", ".pyc"} and "__pycache__" not in p.parts
    ]
    assert data, "no data files found: the package moved?"
    missing = [name for name in data if not any(fnmatch(name, g) for g in globs)]
    assert not missing, f"not in pyproject.toml's package-data: {missing}"


def test_the_kernels_sources_are_among_them():
    from kvchat.engine.kvdirect import exact_attention
    from kvchat.engine.models import int4_kernel
    from kvchat.engine.models.native import build

    globs = shipped_globs()
    for path in (exact_attention.SOURCE, exact_attention.POOL_HEADER, int4_kernel.SOURCE,
                 build.SOURCE):  # fmt: skip
        name = path.relative_to(PACKAGE).as_posix()
        assert any(fnmatch(name, g) for g in globs), name
