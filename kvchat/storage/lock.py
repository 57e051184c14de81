"""Per-conversation exclusive lock across processes, with ``fcntl.flock``.

Why flock: the kernel drops the lock when the holder exits or crashes, so there is never a
stale lock to clean up by hand, and the lock file can stay on disk forever. flock locks belong
to an open file description, so two opens in the *same* process conflict too, which is what we
want: one writer per conversation, full stop.

The holder writes its pid into the file, only so the refusal message can name the process.
Because it truncates the file to do so, the file is opened ``O_NOFOLLOW`` and must be a
regular file with a single link: a ``lock`` planted as a link to another file is refused,
never truncated.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from kvchat.errors import StorageError
from kvchat.storage.manifest import (
    ConversationLockedError,
    ConversationNotFoundError,
    UnsafeFileError,
    one_line,
)
from kvchat.storage.safe_fs import UnsafePathError, open_regular


class ConversationLock:
    """An exclusive, non-blocking lock on ``<conversation>/lock``."""

    def __init__(self, path: Path, conv_id: str) -> None:
        self.path = Path(path)
        self.conv_id = conv_id
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock now or raise ConversationLockedError naming the holder's pid.

        Never waits: a UI that hangs because another window has the conversation open is
        worse than a message saying so.
        """
        if self._fd is not None:
            return
        try:
            fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, single_link=True)
        except UnsafePathError as e:
            raise UnsafeFileError(
                f"lock file {self.path} of conversation {self.conv_id} is refused "
                f"({e.strerror}); remove it (a lock file holds no data) and try again"
            ) from None
        except FileNotFoundError:
            raise ConversationNotFoundError(
                f"conversation {self.conv_id} no longer exists; run `kvchat list`"
            ) from None
        except OSError as e:
            raise StorageError(
                f"cannot open lock file {self.path} of conversation {self.conv_id} "
                f"({one_line(e.strerror)}); check the permissions of that folder"
            ) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise ConversationLockedError(self._held_message(fd)) from None
                raise StorageError(
                    f"cannot lock {self.path} of conversation {self.conv_id} "
                    f"({one_line(e.strerror)}); keep the data folder on a local disk"
                ) from None
            # The conversation may have been deleted between our open and our flock: then we
            # locked an unlinked file. Compare inodes to make sure we hold the live one.
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
            except FileNotFoundError:
                same = False
            if not same:
                raise ConversationNotFoundError(
                    f"conversation {self.conv_id} was just deleted; run `kvchat list`"
                )
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass  # the pid only feeds a message; a full disk must not block opening
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _held_message(self, fd: int) -> str:
        try:
            pid = int(os.pread(fd, 32, 0).decode("ascii", "replace").strip())
        except (OSError, ValueError):
            pid = None
        if pid == os.getpid():
            return (
                f"conversation {self.conv_id} is already open in this kvchat process; "
                "close it first"
            )
        who = f"pid {pid}" if pid is not None else "pid unknown"
        return (
            f"conversation {self.conv_id} is open in another kvchat process ({who}); "
            "close it there first"
        )

    def release(self) -> None:
        """Drop the lock. Idempotent. The pid is erased first so a racing reader never
        blames a process that has let go."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)  # closing the last descriptor releases the flock

    def __del__(self) -> None:
        # A forgotten handle must not keep the conversation locked for the process lifetime.
        try:
            self.release()
        except Exception:
            pass

    def __enter__(self) -> ConversationLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
