"""Compiling ``decode_layer.cpp`` against the installed torch, once, in the background.

Why at run time and not at install: the library links against torch's own C++ libraries,
so it must be built for the torch in use, and building it at ``pip install`` would need
torch inside pip's build environment (a second, multi-GB torch on a fresh machine). A C++
compiler is the only other need; without one (or when a build fails) kvchat decodes in
Python, with the same bits, about 12 % slower (``benchmarks/bench_decode_step.py``).

The library goes to ``<cache dir>/native/decode_layer-<key>.so``, where the key hashes the
source, torch's version and the compiler command, so a new torch or a new source builds
anew and an old library is never loaded into the wrong torch. A build writes a temporary
file and renames it into place, so two kvchat processes never load half a file. The build
runs detached (a session of its own) and finishes its own work, so a Ctrl-C at the terminal
or a kvchat that exits first does not lose it. A failed build leaves
``decode_layer-<key>.failed`` with the compiler's output, and is not retried for that key (a
broken toolchain would otherwise cost a build at every start); delete the file to retry. A
build killed by a signal leaves nothing and runs again at the next start. Nothing here
raises: where the cache cannot be written, the Python step serves. ``KVCHAT_NATIVE=0``
turns all of it off.

This module imports torch only inside the functions that need its paths.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kvchat.paths import cache_dir

SOURCE = Path(__file__).with_name("decode_layer.cpp")
_NICE = 10  # the build shares the machine with the user's first reply

__all__ = ["SOURCE", "Build", "enabled", "library_path", "start"]


def enabled() -> bool:
    """False when ``KVCHAT_NATIVE=0`` (or ``off``/``false``/``no``)."""
    from kvchat.engine.kvdirect.exact_attention import switched_on

    return switched_on("KVCHAT_NATIVE")


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
        # -ffp-contract=off: the library's loops round every product and sum alone.
        cxx, "-O2", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
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


# Run by sh in a session of its own, so that the build ends the same way whatever happens
# to the process that started it (a Ctrl-C at the terminal, an early exit): it puts the
# library in place itself, or records a compiler error; killed by a signal, it leaves
# nothing, and the next start builds again. $1 = library, $2 = temporary, $3 = log,
# $4 = failure marker; then the compiler command.
_FINISH = """
target=$1 temporary=$2 log=$3 failed=$4
shift 4
"$@" >"$log" 2>&1
status=$?
if [ "$status" -eq 0 ] && [ -s "$temporary" ]; then
  rm -f "$log"
  mv -f "$temporary" "$target"
elif [ "$status" -gt 128 ]; then
  rm -f "$temporary" "$log"
else
  rm -f "$temporary"
  [ -s "$log" ] || echo "exit status $status" >"$log"
  mv -f "$log" "$failed"
fi
"""


class Build:
    """A build of the library: already there, or under way in a detached process (which puts
    the library in place, or records its failure, itself)."""

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
        return self.process is None or self.process.poll() is not None

    def wait(self, timeout: float | None = None) -> Path | None:
        """Block until the build ends; the library's path, or None if there is none (yet)."""
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        return self.target if self.target.exists() else None


def start() -> Build | None:
    """The library's build: done if it exists, else started in the background. None when
    disabled, without a compiler or a shell, after a failed build of this key, or where the
    cache cannot be written."""
    found = _compiler_and_target()
    if found is None:
        return None
    cxx, target = found
    if target.exists():
        return Build(target, None)
    if target.with_suffix(".failed").exists():
        return None
    shell = shutil.which("sh")
    if shell is None:
        return None
    build = Build(target, None)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _sweep_leftovers(target)
        # Niced through nice(1), not a preexec_fn: the chat app loads models beside other
        # threads, where a preexec_fn can deadlock the child.
        nice = shutil.which("nice")
        lower = [nice, "-n", str(_NICE)] if nice else []
        build.process = subprocess.Popen(
            [shell, "-c", _FINISH, "kvchat-native-build", str(target), str(build.temporary),
             str(build.log), str(build.failed_marker), *lower,
             *_command(cxx, build.temporary)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    except OSError:
        return None  # an unwritable cache, or no way to run the shell: the Python step serves
    return build


def _sweep_leftovers(target: Path) -> None:
    """Remove temporary and log files of builds that died with their machine: a build takes
    seconds, so anything an hour old is no live build's."""
    now = time.time()
    for leftover in [*target.parent.glob("*.tmp"), *target.parent.glob("*.log")]:
        with contextlib.suppress(OSError):
            if now - leftover.stat().st_mtime > 3600:
                leftover.unlink()
