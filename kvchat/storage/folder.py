"""Reading a conversation's folder: its header and journal, the checks on its files, and
the debris an interrupted save leaves. Needs no lock and changes nothing, except
``clean_debris`` (run by ``ConversationStore.open`` under the conversation's lock).

Layout under ``root/conversations/<id>/``::

    manifest.json                   the header: written at create, never rewritten after
    journal.jsonl                   one record per turn, appended
    segments/turn-0001.safetensors  one new file per turn, never rewritten
    lock                            flock target; holds the pid of the process using it
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.errors import StorageError
from kvchat.storage import journal, segments
from kvchat.storage.atomic import is_temp_name
from kvchat.storage.journal import JOURNAL_NAME
from kvchat.storage.manifest import (
    SEGMENT_NAME_RE,
    ConversationNotFoundError,
    Manifest,
    ManifestError,
    UnsafeFileError,
    one_line,
    parse_header,
)
from kvchat.storage.safe_fs import (
    UnsafePathError,
    check_real_dir,
    check_regular,
    is_symlink,
    read_regular,
)

MANIFEST_NAME = "manifest.json"
SEGMENTS_DIR = "segments"
LOCK_NAME = "lock"


def unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def link_message(what: str, cid: str) -> str:
    return (
        f"{what} of conversation {cid} is a symbolic link, which kvchat never follows; "
        f"run `kvchat delete {cid}` to remove it (only the link goes, not what it points at)"
    )


def check_conversation_dir(path: Path, cid: str) -> None:
    """The conversation folder and its ``segments/`` must be real folders, not links."""
    for directory, what in ((path, "the folder"), (path / SEGMENTS_DIR, "the segments folder")):
        try:
            check_real_dir(directory)
        except FileNotFoundError:
            if directory == path:
                raise ConversationNotFoundError(
                    f"conversation {cid} no longer exists; run `kvchat list`"
                ) from None
            continue  # a missing segments/ folder only matters to a turn that needs it
        except UnsafePathError as e:
            if is_symlink(directory):
                raise UnsafeFileError(link_message(f"{what} {directory}", cid)) from None
            raise UnsafeFileError(
                f"{what} {directory} of conversation {cid} is refused ({e.strerror}); "
                f"run `kvchat delete {cid}`"
            ) from None
        except OSError as e:
            raise StorageError(
                f"cannot read {what} {directory} of conversation {cid} "
                f"({one_line(e.strerror)}); check its permissions"
            ) from None


def read_file(file: Path, conv_id: str, what: str) -> bytes:
    """Whole content of the conversation's manifest or journal; every failure is a one-line
    StorageError naming the file."""
    try:
        return read_regular(file)
    except FileNotFoundError:
        raise ManifestError(
            f"{what} {file} of conversation {conv_id} is missing; "
            f"restore it from a backup or run `kvchat delete {conv_id}`"
        ) from None
    except UnsafePathError as e:
        raise ManifestError(
            f"{what} {file} of conversation {conv_id} is refused ({e.strerror}); "
            f"replace it with the real file or run `kvchat delete {conv_id}`"
        ) from None
    except OSError as e:
        raise ManifestError(
            f"{what} {file} of conversation {conv_id} is unreadable ({one_line(e.strerror)}); "
            "check the file's permissions and the disk"
        ) from None


@dataclass(frozen=True)
class JournalEnd:
    """Where a conversation's journal stands: ``size`` bytes of committed records (the next
    one goes there), ``torn`` bytes after them from an interrupted save."""

    path: Path
    id: str
    size: int
    torn: int = 0


def _highest_segment(path: Path) -> int:
    try:
        names = os.listdir(path / SEGMENTS_DIR)
    except OSError:
        return 0
    found = (SEGMENT_NAME_RE.match(n) for n in names)
    return max((int(m.group(1)) for m in found if m), default=0)


def load_folder(
    path: Path,
    conv_id: str,
    *,
    upto: int | None = None,
    records: list[dict[str, Any]] | None = None,
) -> tuple[Manifest, JournalEnd | None]:
    """The conversation's manifest from its header and journal (or its format 1 manifest:
    then no journal). Needs no lock and changes nothing; every failure is a one-line
    StorageError. ``upto`` and ``records``: see ``journal.read_journal`` (format 2 only)."""
    file = path / MANIFEST_NAME
    raw = read_file(file, conv_id, "manifest")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError(
            f"manifest {file} of conversation {conv_id} is not valid UTF-8 text; "
            f"restore it from a backup or run `kvchat delete {conv_id}`"
        ) from None
    manifest, journal_id = parse_header(text, source=file, conv_id=conv_id)
    # The folder name is the id users type; a folder copied under another name still opens.
    manifest.id = conv_id
    if journal_id is None:
        return manifest, None
    highest = _highest_segment(path)  # before the journal: see journal.read_journal
    jfile = path / JOURNAL_NAME
    found = journal.read_journal(
        read_file(jfile, conv_id, "journal"),
        manifest,
        journal_id=journal_id,
        source=jfile,
        conv_id=conv_id,
        highest_segment=0 if upto is not None else highest,
        upto=upto,
        records=records,
    )
    return manifest, JournalEnd(jfile, journal_id, found.size, found.torn)


def read_header(path: Path, conv_id: str) -> tuple[Manifest, str | None]:
    """The header alone (``manifest.json``: its inline turns, not the journal's) and the id
    of the journal continuing it (None for format 1)."""
    text = read_file(path / MANIFEST_NAME, conv_id, "manifest").decode("utf-8", "replace")
    return parse_header(text, source=path / MANIFEST_NAME, conv_id=conv_id)


def read_manifest(path: str | os.PathLike[str], conv_id: str | None = None) -> Manifest:
    """The manifest of the conversation folder ``path``, as ``list`` and ``export`` read it:
    no lock taken, nothing repaired or swept."""
    path = Path(path)
    return load_folder(path, conv_id or path.name)[0]


def check_writable_journal(state: JournalEnd, cid: str) -> None:
    """The journal is written in place (appended to, a torn end cut): a hard link would
    make that write into someone else's file. Reading it was harmless; writing is refused."""
    try:
        st = check_regular(state.path)
    except OSError as e:
        reason = e.strerror if isinstance(e, UnsafePathError) else one_line(e.strerror)
        raise UnsafeFileError(
            f"journal {state.path} of conversation {cid} is refused ({reason}); "
            f"run `kvchat delete {cid}`"
        ) from None
    if st.st_nlink != 1:
        raise UnsafeFileError(
            f"journal {state.path} of conversation {cid} is refused (it has other hard "
            f"links); copy the conversation folder without links, or run `kvchat delete {cid}`"
        )


def clean_debris(path: Path, manifest: Manifest, journal_state: JournalEnd | None) -> None:
    """Delete what an interrupted save leaves: temporary files, ``turn-NNNN`` segments no
    record names, and a journal beside a format 1 manifest (an interrupted migration made
    it; the manifest does not use it). Other files are left alone (they are not ours).
    Best effort: debris is harmless, so a failure here must not stop the conversation from
    opening. (A torn record is cut by ``open`` itself.)"""
    referenced = {t.segment.file for t in manifest.turns}
    if journal_state is None and not is_symlink(path / JOURNAL_NAME):
        unlink_quietly(path / JOURNAL_NAME)
    for directory, holds_segments in ((path, False), (path / SEGMENTS_DIR, True)):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            orphan = holds_segments and bool(SEGMENT_NAME_RE.match(name)) and name not in referenced
            if is_temp_name(name) or orphan:
                unlink_quietly(directory / name)
                segments.forget(directory / name)
