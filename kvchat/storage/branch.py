"""Sharing a saved turn's segment between conversations: a fork costs links, not copies.

A segment file is never rewritten once its turn is committed (a repair replaces it by
renaming a new file over the name, which leaves other links to the old file as they were),
so two conversations can hold the same file under their own names. Deleting either side
removes only its names; the file goes when the last name does. Where the filesystem cannot
link (another device, FAT, some network mounts), the segment is copied and fsynced instead:
the fork then costs the bytes of its turns, and is just as independent.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from kvchat.storage.safe_fs import NOFOLLOW, PRIVATE_FILE_MODE, check_regular, open_regular

_CANNOT_LINK = {
    errno.EXDEV,
    errno.EPERM,
    errno.EMLINK,
    errno.ENOTSUP,
    errno.EOPNOTSUPP,
    errno.EACCES,
}
_CHUNK = 1 << 20


def share_file(source: Path, target: Path) -> bool:
    """Make ``target`` (which must not exist) hold ``source``'s bytes: a hard link where the
    filesystem allows it (True), else a private copy, fsynced (False). ``source`` must be a
    regular file, never a link (UnsafePathError otherwise). The caller fsyncs the folder."""
    check_regular(source)
    try:
        # Never following: a link swapped in after the check is linked as a link, which
        # every reader of the store refuses, rather than followed to someone's file.
        os.link(source, target, follow_symlinks=False)
        return True
    except OSError as e:
        if e.errno not in _CANNOT_LINK:
            raise
    fd = open_regular(source, os.O_RDONLY)
    try:
        _copy(fd, target)
    finally:
        os.close(fd)
    return False


def _copy(fd: int, target: Path) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    out = os.open(target, flags, PRIVATE_FILE_MODE)
    try:
        os.fchmod(out, PRIVATE_FILE_MODE)
        while chunk := os.read(fd, _CHUNK):
            view = memoryview(chunk)
            while view:
                view = view[os.write(out, view) :]
        os.fsync(out)
    except BaseException:
        os.close(out)
        try:
            os.unlink(target)
        except OSError:
            pass
        raise
    os.close(out)
