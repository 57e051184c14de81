"""Conversations saved by an older kvchat (format 1): one ``manifest.json`` holding every
turn, replaced atomically after each.

They are read as they are (``manifest.parse_header`` takes both formats). Their next save
rewrites them once, atomically, as a format 2 header holding all their turns, continued by
an empty journal created first. ``kvchat repair`` writes format 1 on purpose (one rename
replaces the whole manifest), so the same migration follows a repair.
"""

from __future__ import annotations

from pathlib import Path

from kvchat.storage import atomic, journal
from kvchat.storage.atomic import DirSyncError, write_text_atomic
from kvchat.storage.folder import MANIFEST_NAME, JournalEnd
from kvchat.storage.journal import JOURNAL_NAME
from kvchat.storage.manifest import Manifest


def begin_migration(path: Path, whole: Manifest) -> tuple[str, JournalEnd]:
    """The first save of the format 1 conversation in ``path``, whose manifest with the
    new turn is ``whole``: it becomes a format 2 header continued by an empty journal. The
    journal is emptied (durably) first: a format 1 manifest ignores it, so until the
    header's rename, the commit (``commit_migration``), the conversation on disk is the old
    one. Returns the header to write and where the journal will end."""
    journal_id = journal.new_journal_id()
    journal_path = path / JOURNAL_NAME
    atomic.empty_file(journal_path)
    return whole.to_json(journal_id=journal_id), JournalEnd(journal_path, journal_id, 0)


def commit_migration(path: Path, header: str) -> None:
    """Rename the new header into place: the commit. The caller holds ``header`` before
    this runs, so a save interrupted here can tell from the file whether it committed."""
    try:
        write_text_atomic(path / MANIFEST_NAME, header)
    except DirSyncError:
        pass  # renamed into place: committed; only its durability is in doubt
