"""Atomic file replacement: a reader sees either the old file or the complete new one.

Recipe: write a temporary file in the *same* directory (``rename`` is only atomic within one
filesystem), flush and ``fsync`` it so its bytes are on disk before its name is, ``rename``
it over the target, then ``fsync`` the directory so the rename itself survives a power cut.
Any failure, ``KeyboardInterrupt`` included, removes the temporary file and leaves the target
untouched.

The temporary file is created ``O_EXCL | O_NOFOLLOW`` with mode 0600 (private, whatever the
umask), and ``rename`` replaces a symbolic link at the target rather than writing through it.

Appends (the conversation journal) have no rename to hide behind: ``append_at`` writes at the
offset the caller knows to be the end of what is committed, dropping first whatever an
interrupted earlier append left after it, then fsyncs; the fsync returning is the commit.
A failed append is taken back with ``truncate_durably``. Files appended to are opened
``O_NOFOLLOW | O_NONBLOCK`` and must be regular files with a single link, since they are
written in place.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvchat.storage.safe_fs import NOFOLLOW, NOT_REGULAR_REASON, PRIVATE_FILE_MODE, UnsafePathError

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


# -- in-place files: the journal --------------------------------------------------------------

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted as the journal fails, never hangs


@dataclass
class AppendProgress:
    """How far ``append_at`` got, for a caller whose append was interrupted: ``grew`` once
    a byte may have gone past the committed end, ``synced`` once the fsync returned (the
    record is committed, whatever was raised after)."""

    grew: bool = False
    synced: bool = False


def _open_in_place(path: Path, flags: int) -> int:
    """Open a file we write in place: no link followed, regular, one link, mode 0600."""
    fd = os.open(path, flags | NOFOLLOW | _CLOEXEC | _NONBLOCK, PRIVATE_FILE_MODE)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(errno.ELOOP, NOT_REGULAR_REASON, str(path))
        if st.st_nlink != 1:
            raise UnsafePathError(errno.EMLINK, "it has other hard links", str(path))
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def empty_file(path: Path, *, sync_dir: bool = True) -> None:
    """Create ``path`` (0600) or cut it to nothing, durably; with ``sync_dir`` its folder is
    fsynced too, so the name survives a power cut before anything that relies on it."""
    fd = _open_in_place(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
        os.ftruncate(fd, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    if sync_dir:
        fsync_dir(Path(path).parent)


def append_at(path: Path, data: bytes, at: int, progress: AppendProgress) -> None:
    """Write ``data`` at offset ``at`` of the existing file ``path`` and fsync it.

    ``at`` is where the committed content ends; anything after it (a torn record of an
    earlier, interrupted append) is dropped first. A file shorter than ``at`` was cut by
    someone else: refused, since writing there would leave a hole of zeros. Raises the
    OSError as it comes; ``progress`` says whether the file may have changed.
    """
    fd = _open_in_place(path, os.O_WRONLY)
    try:
        size = os.fstat(fd).st_size
        if size < at:
            raise OSError(errno.EIO, f"{Path(path).name} is shorter than what was saved in it")
        progress.grew = True
        if size > at:
            os.ftruncate(fd, at)
        os.lseek(fd, at, os.SEEK_SET)
        _write_all(fd, data)
        os.fsync(fd)
        progress.synced = True
    finally:
        os.close(fd)


def truncate_durably(path: Path, size: int) -> bool:
    """Cut ``path`` back to ``size`` bytes and fsync it: True once that is on disk. Never
    raises; False means the file may still hold more after a power cut."""
    try:
        fd = _open_in_place(path, os.O_WRONLY)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size > size:
            os.ftruncate(fd, size)
        os.fsync(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
