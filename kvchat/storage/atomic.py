"""Atomic file replacement: a reader sees either the old file or the complete new one.

Recipe: write a temporary file in the *same* directory (``rename`` is only atomic within one
filesystem), flush and ``fsync`` it so its bytes are on disk before its name is, ``rename``
it over the target, then ``fsync`` the directory so the rename itself survives a power cut.
Any failure, ``KeyboardInterrupt`` included, removes the temporary file and leaves the target
untouched.

The temporary file is created ``O_EXCL | O_NOFOLLOW`` with mode 0600 (private, whatever the
umask), and ``rename`` replaces a symbolic link at the target rather than writing through it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from kvchat.storage.safe_fs import NOFOLLOW, PRIVATE_FILE_MODE

TMP_MARK = ".tmp-"
"""Temporary files are named ``.<target name>.tmp-<pid>-<random>``; stray ones are debris."""

_CHUNK = 8 << 20  # bounded os.write calls: a huge single write can be silently short


class DirSyncError(OSError):
    """The rename happened but fsync of the directory failed.

    The new file is already visible, so the write is *committed* as far as this process is
    concerned; only its durability across a power cut is uncertain. Callers that treat the
    rename as their commit point catch this separately from other OSErrors.
    """


def is_temp_name(name: str) -> bool:
    """True for names this module gives its temporary files."""
    return name.startswith(".") and TMP_MARK in name


def fsync_dir(path: Path) -> None:
    """fsync a directory so entries created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """os.write until everything is written; an OSError (ENOSPC...) propagates."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view[:_CHUNK])
        view = view[n:]


def write_atomic(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Replace ``path`` with ``data`` atomically and durably.

    Raises the underlying OSError (the target is then untouched), or DirSyncError after the
    rename if only the final directory fsync failed.
    """
    write_atomic_stream(path, [data])


def write_atomic_stream(path: Path, chunks: Iterable[bytes | bytearray | memoryview]) -> None:
    """``write_atomic`` for data produced piece by piece, never held whole in memory: temp
    file, fsync, rename, directory fsync. On failure the target is untouched and the temp
    file removed."""
    path = Path(path)
    directory = path.parent
    tmp = directory / f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    # O_EXCL: always a fresh regular file, never an existing file or a link's target.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, PRIVATE_FILE_MODE)
    try:
        try:
            os.fchmod(fd, PRIVATE_FILE_MODE)  # exactly 0600: the umask may have removed bits
            for chunk in chunks:
                _write_all(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        fsync_dir(directory)
    except OSError as e:
        raise DirSyncError(e.errno, f"fsync of directory {directory} failed: {e.strerror}") from e


def write_text_atomic(path: Path, text: str) -> None:
    """UTF-8 text through write_atomic."""
    write_atomic(path, text.encode("utf-8"))
