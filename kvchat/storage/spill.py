"""Spill folders: where the disk tier keeps checkpoints moved out of memory before a save.

Layout: ``<data dir>/spill/<pid>-<hex>/L<layer>.bin``, one private folder per session. A
session removes its folder when it closes; a process that is killed leaves it behind. This
module finds those folders, says how much they hold, and removes the ones whose process is
gone. It knows files and processes only (no torch), so ``kvchat list`` and ``kvchat gc`` can
use it without loading the engine.

A folder is stale when no process has its pid, or when the process that has it now started
after the folder was last changed (the pid was reused). A pid of another user's process
counts as alive: not ours to judge. Nothing is followed through a symbolic link: a link in
``spill/`` is removed as a link, and a ``spill/`` that is itself a link is left alone.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvchat.storage.safe_fs import ensure_private_dirs, is_symlink, make_private_dir, tree_bytes

SPILL_DIR_NAME = "spill"

_SESSION_RE = re.compile(r"^(\d+)-[0-9a-f]+$")
_PID_REUSE_SLACK_S = 1.0  # timestamps of a process start and a folder change are not exact


@dataclass(frozen=True)
class SpillFolder:
    """One entry of ``spill/``: its owner's pid (None when the name is not one of ours),
    whether that owner is gone, and the bytes it holds."""

    path: Path
    pid: int | None
    stale: bool
    nbytes: int


def spill_root(data_dir: str | os.PathLike[str]) -> Path:
    """``<data dir>/spill``."""
    return Path(data_dir) / SPILL_DIR_NAME


def _process_started_after(pid: int, moment: float) -> bool:
    """True when the process now running as ``pid`` started after ``moment`` (so it cannot
    be the one that wrote a folder last changed then). False when unknown."""
    try:
        import psutil

        return psutil.Process(pid).create_time() > moment + _PID_REUSE_SLACK_S
    except Exception:  # psutil missing, the process just exited, no access: assume alive
        return False


def _owner_gone(pid: int, folder: Path) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # someone else's process: alive, and not ours to judge
    except OSError:
        return False
    try:
        changed = os.lstat(folder).st_mtime
    except OSError:
        return False
    return _process_started_after(pid, changed)


def spill_folders(data_dir: str | os.PathLike[str]) -> list[SpillFolder]:
    """Every entry of ``<data dir>/spill``, sorted by name; empty when there is none (or
    when ``spill`` is a link, which is never followed)."""
    root = spill_root(data_dir)
    if is_symlink(root):
        return []
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return []
    out = []
    for entry in entries:
        path = Path(entry.path)
        match = _SESSION_RE.match(entry.name)
        pid = int(match.group(1)) if match else None
        stale = pid is not None and _owner_gone(pid, path)
        out.append(SpillFolder(path, pid, stale, tree_bytes(path)))
    return out


def spill_usage(data_dir: str | os.PathLike[str]) -> int:
    """Bytes held in spill files under ``data_dir``, by live sessions and stale ones."""
    return sum(f.nbytes for f in spill_folders(data_dir))


def stale_spill_usage(data_dir: str | os.PathLike[str]) -> int:
    """Bytes held by spill folders whose process is gone (what ``sweep_stale_spill`` frees)."""
    return sum(f.nbytes for f in spill_folders(data_dir) if f.stale)


def sweep_stale_spill(data_dir: str | os.PathLike[str]) -> int:
    """Remove the spill folders of processes that are gone; returns the bytes freed.

    Safe to call at any time from any process: a live session's folder is never touched.
    Best effort: what cannot be removed is left, and not counted.
    """
    freed = 0
    for folder in spill_folders(data_dir):
        if not folder.stale:
            continue
        if is_symlink(folder.path):
            try:
                os.unlink(folder.path)
            except OSError:
                pass
            continue
        shutil.rmtree(folder.path, ignore_errors=True)
        freed += folder.nbytes - tree_bytes(folder.path)
    return freed


def create_spill_folder(data_dir: str | os.PathLike[str]) -> Path:
    """A new private (0700) spill folder for this process, after sweeping stale ones.

    Raises OSError when it cannot be created (the caller words it for the user).
    """
    root = spill_root(data_dir)
    ensure_private_dirs(root)
    if is_symlink(root):
        raise NotADirectoryError(
            errno.ENOTDIR, "it is a symbolic link, which kvchat never follows", str(root)
        )
    sweep_stale_spill(data_dir)
    folder = root / f"{os.getpid()}-{secrets.token_hex(4)}"
    make_private_dir(folder)
    return folder
