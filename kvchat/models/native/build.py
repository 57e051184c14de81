"""Compiling ``decode_layer.cpp`` against the installed torch, once, in the background.

Why at run time and not at install: the library links against torch's own C++ libraries,
so it must be built for the torch in use, and building it at ``pip install`` would need
torch inside pip's build environment (a second, multi-GB torch on a fresh machine). A C++
compiler is the only other need; without one (or when a build fails) kvchat decodes in
Python, with the same bits, about 12 % slower (``benchmarks/bench_decode_step.py``).

The library goes to ``<cache dir>/native/decode_layer-<key>.so``, where the key hashes the
source, torch's version and the compiler command, so a new torch or a new source builds
anew and an old library is never loaded into the wrong torch. A build writes a temporary
file and renames it into place, so two kvchat processes never load half a file. A failed
build leaves ``decode_layer-<key>.failed`` with the compiler's output, and is not retried
for that key (a broken toolchain would otherwise cost a build at every start); delete the
file to retry. ``KVCHAT_NATIVE=0`` turns all of it off.

This module imports torch only inside the functions that need its paths.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvchat.paths import cache_dir

SOURCE = Path(__file__).with_name("decode_layer.cpp")
_NICE = 10  # the build shares the machine with the user's first reply

__all__ = ["SOURCE", "Build", "enabled", "library_path", "start"]


def enabled() -> bool:
    """False when ``KVCHAT_NATIVE=0`` (or ``off``/``false``/``no``)."""
    return os.environ.get("KVCHAT_NATIVE", "1").strip().lower() not in {"0", "off", "false", "no"}


def compiler() -> str | None:
    """``$CXX``, else the first of c++, g++, clang++ on PATH."""
    chosen = os.environ.get("CXX")
    if chosen:
        return shutil.which(chosen)
    return next((found for c in ("c++", "g++", "clang++") if (found := shutil.which(c))), None)


def _command(cxx: str, output: Path) -> list[str]:
    import torch

    # torch.utils.cpp_extension knows these paths too, but importing it imports setuptools
    # (0.1 s and 4 MiB in every chat process); a wheel's layout is include/ and lib/.
    root = Path(torch.__file__).resolve().parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{root / 'include'}"]
    libraries = [str(root / "lib")]
    links = [f"-L{p}" for p in libraries] + [f"-Wl,-rpath,{p}" for p in libraries]
    return [
        cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes, str(SOURCE), *links, "-ltorch_cpu", "-lc10", "-o", str(output),
    ]  # fmt: skip


def _key(cxx: str) -> str:
    import torch

    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(f"{torch.__version__}|{sys.version_info[:2]}|{cxx}".encode())
    digest.update(" ".join(_command(cxx, Path("out"))).encode())
    return digest.hexdigest()[:16]


def _compiler_and_target() -> tuple[str, Path] | None:
    if not enabled():
        return None
    cxx = compiler()
    if cxx is None:
        return None
    return cxx, cache_dir() / "native" / f"decode_layer-{_key(cxx)}.so"


def library_path() -> Path | None:
    """Where this torch's library is, or is to be built (None: no compiler, or disabled)."""
    found = _compiler_and_target()
    return None if found is None else found[1]


class Build:
    """A build of the library: already there, under way, or failed."""

    def __init__(self, target: Path, process: subprocess.Popen[bytes] | None) -> None:
        self.target = target
        self.process = process
        self.temporary = target.with_suffix(f".{os.getpid()}.tmp")
        self.log = target.with_suffix(f".{os.getpid()}.log")

    @property
    def failed_marker(self) -> Path:
        return self.target.with_suffix(".failed")

    def done(self) -> bool:
        """Whether the build has ended (either way); never blocks."""
        if self.process is None:
            return True
        if self.process.poll() is None:
            return False
        self._finish()
        return True

    def wait(self, timeout: float | None = None) -> Path | None:
        """Block until the build ends; the library's path, or None if it failed."""
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
            self._finish()
        return self.target if self.target.exists() else None

    def _finish(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.returncode == 0 and self.temporary.exists():
            os.replace(self.temporary, self.target)
            self.log.unlink(missing_ok=True)
            return
        self.temporary.unlink(missing_ok=True)
        if not self.log.exists() or not self.log.stat().st_size:
            self.log.write_text(f"exit status {process.returncode}\n")
        os.replace(self.log, self.failed_marker)


def start() -> Build | None:
    """The library's build: done if it exists, else started in the background. None when
    disabled, without a compiler, or after a failed build of this key."""
    found = _compiler_and_target()
    if found is None:
        return None
    cxx, target = found
    if target.exists():
        return Build(target, None)
    if target.with_suffix(".failed").exists():
        return None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # an unwritable cache: the Python step serves
    build = Build(target, None)
    try:
        # Into a file, not a pipe: a long error would fill a pipe nobody reads until the end.
        # Niced through nice(1), not a preexec_fn: the chat app loads models beside other
        # threads, where a preexec_fn can deadlock the child.
        nice = shutil.which("nice")
        lower = [nice, "-n", str(_NICE)] if nice else []
        with build.log.open("wb") as log:
            build.process = subprocess.Popen(
                [*lower, *_command(cxx, build.temporary)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
    except OSError as exc:
        build.log.unlink(missing_ok=True)
        build.failed_marker.write_text(f"could not run {cxx}: {exc}")
        return None
    return build
