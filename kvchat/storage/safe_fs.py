"""Store files opened without following links, and created private whatever the umask.

A conversation folder may come from someone else (a copy, an archive). If its ``lock`` or
``manifest.json`` were a symbolic link, opening it for writing would truncate whatever file
the link points at. So every file the store opens is opened with ``O_NOFOLLOW`` and must be a
regular file, and every folder the store creates is ``0700``, every file ``0600``: the umask
can only remove permission bits, so the modes are also set explicitly after creation.

Only the last path component is checked here; callers check the conversation folder itself
(``lstat``) before opening anything inside it. Folders above the store (the data dir, its
``conversations/``) may be links: the user chose where the data lives.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # so a FIFO planted as a store file cannot hang us

SYMLINK_REASON = "it is a symbolic link, which kvchat never follows"
NOT_REGULAR_REASON = "it is not a regular file"


class UnsafePathError(OSError):
    """A store path is a symbolic link or not the kind of file it should be. ``strerror``
    says which, in words that fit inside a user-facing message."""


def _refuse(path: Path, reason: str) -> UnsafePathError:
    return UnsafePathError(errno.ELOOP, reason, str(path))


def is_symlink(path: Path) -> bool:
    """True when ``path`` itself is a symbolic link (never follows it)."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def open_regular(
    path: Path, flags: int, mode: int = PRIVATE_FILE_MODE, *, single_link: bool = False
) -> int:
    """``os.open`` that refuses a symbolic link or a non-regular file as ``path``.

    When opened for writing, a file of ours gets exactly ``mode``, whether this call
    created it (the umask may have removed bits) or an older kvchat left it 0644.
    ``single_link`` also refuses a file with other hard links (for files we truncate: a
    hard link to someone's file is as dangerous as a symbolic one).
    Raises UnsafePathError for a link or a non-regular file, other OSErrors as they come.
    """
    path = Path(path)
    try:
        fd = os.open(path, flags | NOFOLLOW | _CLOEXEC | _NONBLOCK, mode)
    except OSError as e:
        # Linux says ELOOP for O_NOFOLLOW on a link, FreeBSD EMLINK, NetBSD EFTYPE.
        if e.errno in (errno.ELOOP, errno.EMLINK, getattr(errno, "EFTYPE", -1)) and is_symlink(
            path
        ):
            raise _refuse(path, SYMLINK_REASON) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, NOT_REGULAR_REASON)
        if single_link and st.st_nlink != 1:
            raise _refuse(path, "it has other hard links")
        if _NONBLOCK:
            os.set_blocking(fd, True)
        writing = flags & (os.O_WRONLY | os.O_RDWR)
        if writing and stat.S_IMODE(st.st_mode) != mode and st.st_uid == os.getuid():
            try:
                os.fchmod(fd, mode)
            except OSError:
                pass  # not ours to change; the file stays readable as it was
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path) -> bytes:
    """Whole content of a regular file, refusing links (see ``open_regular``)."""
    fd = open_regular(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def check_regular(path: Path) -> os.stat_result:
    """``lstat`` a file that must be a regular file, not a link: UnsafePathError otherwise
    (FileNotFoundError and other OSErrors pass through)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(Path(path), SYMLINK_REASON)
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(Path(path), NOT_REGULAR_REASON)
    return st


def check_real_dir(path: Path) -> None:
    """A folder the store keeps things in must be a folder, not a link to one."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(Path(path), SYMLINK_REASON)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(Path(path), "it is not a folder")


def make_private_dir(path: Path) -> None:
    """Create one folder with mode exactly 0700 (FileExistsError if it exists)."""
    os.mkdir(path, PRIVATE_DIR_MODE)
    os.chmod(path, PRIVATE_DIR_MODE, follow_symlinks=False)


def ensure_private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parents, each 0700. Folders that already exist are
    left as they are, except that kvchat's own ``path`` is tightened to 0700 when we own it
    and it is open to others (created by an older kvchat under a permissive umask)."""
    path = Path(path)
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        try:
            make_private_dir(directory)
        except FileExistsError:
            pass  # created meanwhile by another process
    if not missing:
        tighten_dir(path)
    if not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(path))


def tighten_dir(path: Path) -> None:
    """chmod 0700 a folder of ours that group or others can open. Best effort."""
    try:
        st = os.lstat(path)
        if (
            stat.S_ISDIR(st.st_mode)
            and st.st_uid == os.getuid()
            and stat.S_IMODE(st.st_mode) & 0o077
        ):
            os.chmod(path, PRIVATE_DIR_MODE)
    except OSError:
        pass


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path``, links not followed."""
    return tree_usage(path)[0]


def tree_usage(path: Path) -> tuple[int, int]:
    """``(bytes, shared)``: bytes of the regular files under ``path`` (links not followed),
    and how many of them are in files with other hard links (a fork's shared segments:
    removing ``path`` does not free those)."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0, 0
    if not stat.S_ISDIR(st.st_mode):
        if not stat.S_ISREG(st.st_mode):
            return 0, 0
        return st.st_size, st.st_size if st.st_nlink > 1 else 0
    total = shared = 0
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0, 0
    for entry in entries:
        size, common = tree_usage(Path(entry.path))
        total, shared = total + size, shared + common
    return total, shared
