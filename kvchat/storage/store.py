"""The conversation store: a folder per conversation, a header, a journal, one segment per turn.

Layout under ``root/conversations/<id>/``::

    manifest.json                   the header: written at create, never rewritten after
    journal.jsonl                   one record per turn, appended
    segments/turn-0001.safetensors  one new file per turn, never rewritten
    lock                            flock target; holds the pid of the process using it

Crash safety rests on one ordering: a turn's segment is written and fsynced *before* the
record that names it is appended and fsynced, and that fsync is the commit. Whatever is
interrupted (power, ENOSPC, Ctrl-C) the journal holds every earlier record whole, plus at
most a torn last one that readers ignore; every segment a record names is complete. A failed
append is cut back before its segment is deleted, and a segment is kept if that cut cannot
be made durable (the record might survive a power cut). Segment files that no record names,
torn records and temporary files are debris from an interrupted save and are removed the
next time the conversation is opened. See ``journal`` for the record format and why it is a
journal, and ``manifest`` for the header.

A conversation saved by an older kvchat (format 1: one ``manifest.json`` holding every turn,
replaced atomically after each) is read as it is; its next save rewrites it once, atomically,
as a format 2 header holding all its turns, with an empty journal created first.

Nothing in the store is followed through a symbolic link: a conversation folder, its
``segments/``, manifest, journal, segments or lock that is a link is refused (``list`` shows it
as an error row, ``open``/``export`` refuse it, ``delete`` removes the link itself and nothing
it points at). Folders are created 0700 and files 0600 whatever the umask: conversations are
private text.

Storage knows files, not models: tensors go in and come out by name; what they mean (residual
checkpoints, chunk boundaries in ``engine_state``) is the engine's business.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import operator
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvchat.errors import StorageError
from kvchat.storage import atomic, journal, segments
from kvchat.storage.atomic import (
    TMP_MARK,
    DirSyncError,
    fsync_dir,
    is_temp_name,
    write_text_atomic,
)
from kvchat.storage.branch import share_file
from kvchat.storage.journal import JOURNAL_NAME
from kvchat.storage.lock import ConversationLock
from kvchat.storage.manifest import (
    FORMAT_VERSION,
    SEGMENT_NAME_RE,
    AmbiguousConversationError,
    ConversationNotFoundError,
    ForkOrigin,
    Manifest,
    ManifestError,
    ModelInfo,
    ModelMismatchError,
    SaveFailedError,
    Turn,
    UnsafeFileError,
    make_title,
    one_line,
    parse_header,
    segment_file_name,
    utc_now,
)
from kvchat.storage.safe_fs import (
    UnsafePathError,
    check_real_dir,
    check_regular,
    ensure_private_dirs,
    is_symlink,
    make_private_dir,
    open_regular,
    read_regular,
    tree_bytes,
    tree_usage,
)
from kvchat.storage.text import safe_terminal_text

if TYPE_CHECKING:  # tensors pass through the store by name; torch is imported where used
    import torch

MANIFEST_NAME = "manifest.json"
SEGMENTS_DIR = "segments"
LOCK_NAME = "lock"

_ID_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z_-]*$")  # no dots or slashes: ids are dir names
_CREATING = ".creating-"
_DELETING = ".deleting-"


@dataclass(frozen=True)
class ConversationSummary:
    """One row of ``kvchat list``. ``error`` is set (one line, with the fix) when the
    conversation cannot be opened; the other fields are then best effort."""

    id: str
    title: str
    model: str
    turns: int
    tokens: int
    bytes_on_disk: int
    last_used: datetime
    error: str | None = None
    forked_from: ForkOrigin | None = None
    shared_bytes: int = 0  # of bytes_on_disk, in segments shared with forks (not freed by delete)


@dataclass(frozen=True)
class DeleteOutcome:
    """What ``delete`` did. ``link_only``: the conversation entry was a symbolic link and
    only the link was removed. ``leftover``: a hidden folder that could not be removed
    completely (the conversation is gone from every listing; ``sweep_leftovers`` retries)."""

    id: str
    link_only: bool = False
    leftover: Path | None = None


def _json_copy(value: Any, what: str) -> Any:
    """Deep copy through JSON: proves now, before any file is touched, that the value can be
    saved, and detaches it from the caller's later mutations."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serialisable: {e}") from None


def _json_dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a dict, not {type(value).__name__}")
    return _json_copy(dict(value), what)


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    copy = _json_copy(messages, "messages")
    if not isinstance(copy, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in copy
    ):
        raise TypeError("messages must be a list of {'role': str, 'content': str} dicts")
    return copy


def _checked_ids(token_ids: Any) -> list[int]:
    if any(isinstance(t, bool) for t in token_ids):
        raise TypeError("token_ids must be ints, not bools")
    # operator.index accepts Python, numpy and 0-d torch integers and refuses floats.
    return [operator.index(t) for t in token_ids]


def _title(old: Manifest, messages: list[dict[str, Any]]) -> str:
    """The title once the turn is saved: set from the first user message, then kept."""
    if old.title:
        return old.title
    first_user = next((m for m in [*old.messages, *messages] if m["role"] == "user"), None)
    return make_title(first_user["content"]) if first_user else ""


def _new_id() -> str:
    """``20261130-024512-3fa2``: UTC creation time (so ids sort by age) plus 16 random bits
    (so two conversations created in the same second do not collide)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(2)}"


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _link_message(what: str, cid: str) -> str:
    return (
        f"{what} of conversation {cid} is a symbolic link, which kvchat never follows; "
        f"run `kvchat delete {cid}` to remove it (only the link goes, not what it points at)"
    )


def _check_conversation_dir(path: Path, cid: str) -> None:
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
                raise UnsafeFileError(_link_message(f"{what} {directory}", cid)) from None
            raise UnsafeFileError(
                f"{what} {directory} of conversation {cid} is refused ({e.strerror}); "
                f"run `kvchat delete {cid}`"
            ) from None
        except OSError as e:
            raise StorageError(
                f"cannot read {what} {directory} of conversation {cid} "
                f"({one_line(e.strerror)}); check its permissions"
            ) from None


def _read_file(file: Path, conv_id: str, what: str) -> bytes:
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
class _Journal:
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


def _load(
    path: Path,
    conv_id: str,
    *,
    upto: int | None = None,
    records: list[dict[str, Any]] | None = None,
) -> tuple[Manifest, _Journal | None]:
    """The conversation's manifest from its header and journal (or its format 1 manifest:
    then no journal). Needs no lock and changes nothing; every failure is a one-line
    StorageError. ``upto`` and ``records``: see ``journal.read_journal`` (format 2 only)."""
    file = path / MANIFEST_NAME
    raw = _read_file(file, conv_id, "manifest")
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
        _read_file(jfile, conv_id, "journal"),
        manifest,
        journal_id=journal_id,
        source=jfile,
        conv_id=conv_id,
        highest_segment=0 if upto is not None else highest,
        upto=upto,
        records=records,
    )
    return manifest, _Journal(jfile, journal_id, found.size, found.torn)


def _header(path: Path, conv_id: str) -> tuple[Manifest, str | None]:
    """The header alone (``manifest.json``: its inline turns, not the journal's) and the id
    of the journal continuing it (None for format 1)."""
    text = _read_file(path / MANIFEST_NAME, conv_id, "manifest").decode("utf-8", "replace")
    return parse_header(text, source=path / MANIFEST_NAME, conv_id=conv_id)


def read_manifest(path: str | os.PathLike[str], conv_id: str | None = None) -> Manifest:
    """The manifest of the conversation folder ``path``, as ``list`` and ``export`` read it:
    no lock taken, nothing repaired or swept."""
    path = Path(path)
    return _load(path, conv_id or path.name)[0]


def _holds(path: Path, at: int, record: bytes) -> bool:
    """True when ``path`` holds exactly ``record`` from offset ``at`` to its end."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.fstat(fd).st_size == at + len(record) and os.pread(fd, len(record), at) == record
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Saved:
    """What is on disk: the manifest, and where the journal ends (the next record's offset)."""

    manifest: Manifest
    journal: _Journal | None


@dataclass
class _Save:
    """One save in progress: what the turn adds, and how far writing it got (to decide,
    after a failure, whether it committed)."""

    seg_path: Path
    turn: Turn
    messages: list[dict[str, Any]]
    token_ids: list[int]
    title: str
    updated: str
    state: dict[str, Any]
    n_messages_before: int
    journal: _Journal | None = None  # where the journal ends once this save commits
    record: bytes = b""
    header: str = ""
    progress: atomic.AppendProgress = dataclasses.field(default_factory=atomic.AppendProgress)


class Conversation:
    """An open conversation, locked for this handle until ``close()``.

    Use as a context manager. Methods are safe to call from several threads, but the object
    is meant for one engine session.
    """

    def __init__(
        self, path: Path, manifest: Manifest, lock: ConversationLock, journal: _Journal | None
    ) -> None:
        self.path = Path(path)
        self.id = self.path.name
        self._saved = _Saved(manifest, journal)
        self._adopting: _Save | None = None
        self._lock = lock
        self._mutex = threading.RLock()

    @property
    def manifest(self) -> Manifest:
        """Everything saved so far. The same object all along: each save that commits
        extends it in place (copying it would make a save cost the whole conversation)."""
        return self._saved.manifest

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return not self._lock.held

    def close(self) -> None:
        """Release the lock so another process can open the conversation. Idempotent."""
        self._lock.release()

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Conversation {self.id} turns={len(self.manifest.turns)} {state}>"

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"conversation {self.id} is closed")

    # -- writing -------------------------------------------------------------------------

    def append_turn(
        self,
        *,
        messages: list[dict[str, Any]],
        token_ids: list[int],
        tensors: Mapping[str, torch.Tensor | segments.StreamedTensor],
        extra: dict[str, Any] | None = None,
        engine_state: dict[str, Any] | None = None,
    ) -> None:
        """Save one turn: the messages and token ids it *added* (appended to the manifest's
        lists), its tensors (a new segment file), per-turn ``extra`` and, if given, a new
        ``engine_state`` (replaces the old one whole).

        Order: segment written and fsynced, then the turn's record appended to the journal
        and fsynced (the commit); what is written is what this turn adds, whatever the
        length of the conversation. Until that fsync, the on-disk conversation is exactly
        the previous turn; so on any failure it still is. The first save of a conversation
        of the old format rewrites its manifest once instead (see ``_migrate``). OSErrors
        (disk full...) become SaveFailedError; KeyboardInterrupt is re-raised after the
        same cleanup. ``self.manifest`` only changes (in place) once the turn is on disk,
        so a failed call can simply be retried.
        """
        with self._mutex:
            self._check_open()
            if self._adopting is not None:  # a second interrupt cut the last adoption short
                self._adopt(self._adopting)
            new_messages = _checked_messages(messages)
            new_ids = _checked_ids(token_ids)
            extra_copy = _json_dict(extra or {}, "extra")
            old = self._saved.manifest
            state = (
                old.engine_state
                if engine_state is None
                else _json_dict(engine_state, "engine_state")
            )
            streamed = any(isinstance(t, segments.StreamedTensor) for t in tensors.values())
            if streamed:
                data = None
                info = segments.SegmentInfo(file="", sha256="", nbytes=0)
            else:
                data, info = segments.encode(tensors)
            index = len(old.turns) + 1
            info.file = segment_file_name(index)
            save = _Save(
                seg_path=self.path / SEGMENTS_DIR / info.file,
                turn=Turn(index, len(old.token_ids) + len(new_ids), info, extra_copy),
                messages=new_messages,
                token_ids=new_ids,
                title=_title(old, new_messages),
                updated=utc_now(),
                state=state,
                n_messages_before=len(old.messages),
            )
            try:
                if streamed:
                    written = segments.write_segment_stream(save.seg_path, tensors)
                    info.sha256, info.nbytes = written.sha256, written.nbytes
                else:
                    segments.write_segment(save.seg_path, data)
                if self._saved.journal is None:
                    self._migrate(save)
                else:
                    self._append(save)
                self._adopt(save)
            except OSError as e:
                if not self._settle_failed_save(save, interrupted=False):
                    raise SaveFailedError(self._save_failed_message(index, e)) from e
            except BaseException:
                self._settle_failed_save(save, interrupted=True)
                raise

    def staging_path(self, index: int) -> Path:
        """Where a rebuilt segment of turn ``index`` is written before it replaces the old
        one: a temporary name, so a crash leaves debris that the next open sweeps."""
        name = self._turn(index).segment.file
        return self.path / SEGMENTS_DIR / f".{name}{TMP_MARK}repair-{os.getpid()}"

    def replace_segments(self, staged: Mapping[int, segments.SegmentInfo]) -> None:
        """Put rebuilt segments (written at ``staging_path(index)``, described by ``staged``)
        in place of turns' segments, and record their checksums.

        Rare (``kvchat repair``), so it rewrites the manifest whole, as one format 1 file
        (which ignores the journal) in one rename; the next save makes it a header and a
        journal again (``_migrate``). Each segment is renamed over the old one first: a
        crash before the manifest's rename leaves a segment that fails its old checksum,
        so the conversation reads as damaged at that turn, and the repair, run again,
        fixes it.
        """
        with self._mutex:
            self._check_open()
            m = self._saved.manifest
            infos = {}
            for index, info in staged.items():
                target = self._turn(index).segment.file
                infos[index] = segments.SegmentInfo(target, info.sha256, info.nbytes)
            turns = [
                dataclasses.replace(t, segment=infos[t.index]) if t.index in infos else t
                for t in m.turns
            ]
            whole = dataclasses.replace(m, turns=turns, updated=utc_now(), format_version=1)
            try:
                for index in infos:
                    final = self.path / SEGMENTS_DIR / infos[index].file
                    segments.forget(final)
                    os.replace(self.staging_path(index), final)
                fsync_dir(self.path / SEGMENTS_DIR)
                try:
                    write_text_atomic(self.path / MANIFEST_NAME, whole.to_json())
                except DirSyncError:
                    pass  # renamed into place: committed
            except OSError as e:
                raise SaveFailedError(
                    f"rebuilding conversation {self.id} failed while replacing its segments "
                    f"({one_line(e.strerror or e)}); check the disk and run the repair again"
                ) from e
            m.turns[:] = turns
            m.updated, m.format_version = whole.updated, 1
            self._saved = _Saved(m, None)
            for info in infos.values():
                segments.remember(self.path / SEGMENTS_DIR / info.file, info.sha256)

    def _append(self, save: _Save) -> None:
        """Append the turn's record at the end of what is committed, and fsync it."""
        committed = self._saved.journal
        assert committed is not None
        save.record = journal.turn_record(
            journal_id=committed.id,
            turn=save.turn,
            title=save.title,
            updated=save.updated,
            messages=save.messages,
            token_ids=save.token_ids,
            state=journal.state_delta(self._saved.manifest.engine_state, save.state),
        )
        save.journal = dataclasses.replace(
            committed, size=committed.size + len(save.record), torn=0
        )
        atomic.append_at(committed.path, save.record, committed.size, save.progress)

    def _migrate(self, save: _Save) -> None:
        """First save of a format 1 conversation: the whole manifest, this turn included,
        becomes a format 2 header continued by an empty journal. The journal is emptied
        (durably) first: a format 1 manifest ignores it, so until the header's rename,
        the commit, the conversation on disk is the old one."""
        old = self._saved.manifest
        journal_id = journal.new_journal_id()
        path = self.path / JOURNAL_NAME
        atomic.empty_file(path)
        whole = dataclasses.replace(
            old,
            title=save.title,
            updated=save.updated,
            messages=old.messages + save.messages,
            token_ids=old.token_ids + save.token_ids,
            turns=[*old.turns, save.turn],
            engine_state=save.state,
            format_version=FORMAT_VERSION,
        )
        save.header = whole.to_json(journal_id=journal_id)
        save.journal = _Journal(path, journal_id, 0)
        try:
            write_text_atomic(self.path / MANIFEST_NAME, save.header)
        except DirSyncError:
            pass  # renamed into place: committed; only its durability is in doubt

    def _adopt(self, save: _Save) -> None:
        """Make the in-memory conversation what the committed save left on disk, in place.

        Idempotent (lists are cut back to their length before the save, then extended), so
        an interrupt inside it is finished by running it again: by the cleanup of the same
        call, or, should a second interrupt cut that short too, at the start of the next.
        """
        self._adopting = save
        m = self._saved.manifest
        del m.messages[save.n_messages_before :]
        del m.token_ids[save.turn.n_tokens_total_after - len(save.token_ids) :]
        del m.turns[save.turn.index - 1 :]
        m.messages.extend(save.messages)
        m.token_ids.extend(save.token_ids)
        m.turns.append(save.turn)
        m.title, m.updated, m.engine_state = save.title, save.updated, save.state
        m.format_version = FORMAT_VERSION
        self._saved = _Saved(m, save.journal)
        self._adopting = None
        try:
            segments.remember(save.seg_path, save.turn.segment.sha256)
        except OSError:
            pass  # only spares a re-hash later

    def _settle_failed_save(self, save: _Save, *, interrupted: bool) -> bool:
        """After a failed or interrupted save, find out whether it made it to disk.

        If it did (an interrupt landed after the commit) adopt it; otherwise take back
        what the save wrote and delete the now-unreferenced segment. If we cannot tell, or
        a record may survive a power cut, keep the segment: open() cleans up.
        Returns True when the save is in fact committed.
        """
        verdict = self._verdict(save, interrupted)
        if verdict == "committed":
            self._adopt(save)  # first: a second Ctrl-C in the fsync below must not undo it
            if not save.progress.synced and save.record and save.journal is not None:
                atomic.truncate_durably(save.journal.path, save.journal.size)
        elif verdict == "not saved":
            _unlink_quietly(save.seg_path)
            segments.forget(save.seg_path)
        return verdict == "committed"

    def _verdict(
        self, save: _Save, interrupted: bool
    ) -> Literal["committed", "not saved", "unknown"]:
        if save.progress.synced:
            return "committed"
        if save.header:  # a migrating save: committed once the header is in place
            try:
                on_disk = (self.path / MANIFEST_NAME).read_text("utf-8")
            except (OSError, ValueError):
                return "unknown"
            return "committed" if on_disk == save.header else "not saved"
        committed = self._saved.journal
        if not save.progress.grew or committed is None:
            return "not saved"
        # An interrupt (not a write error) after the whole record reached the file: fsync
        # cannot be interrupted, so this is most often one that landed just after it.
        if interrupted and _holds(committed.path, committed.size, save.record):
            return "committed"
        if not atomic.truncate_durably(committed.path, committed.size):
            return "unknown"  # the record may be on disk after a power cut: so must its segment
        return "not saved"

    def _save_failed_message(self, index: int, e: OSError) -> str:
        if index == 1:
            intact = "the conversation is intact with no turns saved"
        elif index == 2:
            intact = "turn 1 is intact on disk"
        else:
            intact = f"turns 1-{index - 1} are intact on disk"
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free some disk space and try again"
        else:
            fix = "check the disk and try again"
        reason = one_line(e.strerror or e)
        return f"saving turn {index} of conversation {self.id} failed ({reason}); {intact} — {fix}"

    # -- reading -------------------------------------------------------------------------

    def _turn(self, index: int) -> Turn:
        turns = self.manifest.turns
        if not 1 <= index <= len(turns):
            raise IndexError(f"conversation {self.id} has turns 1..{len(turns)}, not {index}")
        return turns[index - 1]

    def segment_path(self, index: int) -> Path:
        """Path of turn ``index``'s segment file (turns count from 1)."""
        return self.path / SEGMENTS_DIR / self._turn(index).segment.file

    def read_turn_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """All tensors of turn ``index`` (from 1), after verifying the file's sha256.

        Raises SegmentCorruptedError for a missing, truncated or altered file; other turns
        stay readable.
        """
        self._check_open()
        turn = self._turn(index)
        return segments.read_segment(self.segment_path(index), turn.segment, self.id)

    def iter_tensors(self) -> Iterator[tuple[int, str, torch.Tensor]]:
        """Yield ``(turn_index, name, tensor)`` turn by turn, one tensor in memory at a time.

        Each file's checksum is verified before its first tensor is yielded, so a corrupted
        turn raises SegmentCorruptedError when the iteration reaches it.
        """
        self._check_open()
        for turn in list(self.manifest.turns):
            path = self.path / SEGMENTS_DIR / turn.segment.file
            for name, tensor in segments.iter_segment(path, turn.segment, self.id):
                yield turn.index, name, tensor

    def tensor_layout(self, index: int) -> dict[str, segments.TensorLocation]:
        """Where each tensor of turn ``index`` sits in its segment file (after verifying it),
        so the engine can read rows back in bounded pieces instead of loading the turn."""
        self._check_open()
        turn = self._turn(index)
        path = self.segment_path(index)
        segments.verify(path, turn.segment, self.id)
        return segments.tensor_layout(path)

    def open_slice(self, index: int, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` along the first dimension of tensor ``name`` of turn
        ``index``, read without loading the rest of the file.

        The file's checksum is verified the first time this process touches it (then
        remembered), which keeps repeated small slices cheap.
        """
        self._check_open()
        turn = self._turn(index)
        return segments.read_slice(
            self.segment_path(index), turn.segment, self.id, name, start, stop
        )


class ConversationStore:
    """All saved conversations under ``root/conversations``.

    ``root`` is the data directory (``kvchat.paths.data_dir(override)``). Nothing is created
    on disk until the first ``create``.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.conversations_dir = self.root / "conversations"

    def __repr__(self) -> str:
        return f"<ConversationStore {self.conversations_dir}>"

    # -- lookup --------------------------------------------------------------------------

    def _ids(self) -> list[str]:
        """Every conversation entry: real folders, and links (which are listed so that they
        can be seen and deleted, never followed)."""
        try:
            entries = list(os.scandir(self.conversations_dir))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            if not self.root.is_dir():
                raise StorageError(
                    f"{self.root} is not a folder; pass --data-dir a folder "
                    "(or a path that does not exist yet)"
                ) from None
            raise StorageError(
                f"{self.conversations_dir} is not a folder, so {self.root} cannot hold "
                "conversations; move that file away or pass another --data-dir"
            ) from None
        except OSError as e:
            raise StorageError(
                f"cannot read the conversation folder {self.conversations_dir} "
                f"({one_line(e.strerror)}); check its permissions"
            ) from None
        return sorted(
            e.name
            for e in entries
            if _ID_RE.match(e.name) and (e.is_dir(follow_symlinks=False) or e.is_symlink())
        )

    def resolve(self, conv_id: str) -> str:
        """Full id for an id or an unambiguous prefix of one (so the CLI can show what a
        prefix means before, say, deleting it)."""
        exact = self.conversations_dir / conv_id
        if conv_id and _ID_RE.match(conv_id) and (exact.is_dir() or is_symlink(exact)):
            return conv_id
        matches = [i for i in self._ids() if conv_id and i.startswith(conv_id)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise ConversationNotFoundError(
                f"no conversation {conv_id!r} in {self.conversations_dir}; "
                "run `kvchat list` to see the saved ones"
            )
        shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
        raise AmbiguousConversationError(
            f"{conv_id!r} matches {len(matches)} conversations ({shown}); type more of the id"
        )

    # -- create / open -------------------------------------------------------------------

    def create(
        self, *, model_name: str, fingerprint: str, dtype: str, settings: dict[str, Any]
    ) -> Conversation:
        """New, empty, locked conversation.

        It is assembled in a hidden ``.creating-*`` folder and renamed into place complete,
        so ``list()`` never sees a conversation without its header and (empty) journal.
        """
        for name, value in (("model_name", model_name), ("fingerprint", fingerprint)):
            if not isinstance(value, str) or not value:
                raise TypeError(f"{name} must be a non-empty string")
        if not isinstance(dtype, str) or not dtype:
            raise TypeError("dtype must be a non-empty string such as 'bfloat16'")
        settings = _json_dict(settings, "settings")
        try:
            ensure_private_dirs(self.conversations_dir)
        except OSError as e:
            raise StorageError(
                f"cannot create the conversation folder {self.conversations_dir} "
                f"({one_line(e.strerror)}); check the disk and --data-dir"
            ) from None

        def fill(staging: Path, conv_id: str) -> tuple[Manifest, str]:
            now = utc_now()
            manifest = Manifest(
                id=conv_id,
                title="",
                created=now,
                updated=now,
                model=ModelInfo(name=model_name, fingerprint=fingerprint, dtype=dtype),
                settings=settings,
            )
            journal_id = journal.new_journal_id()
            atomic.empty_file(staging / JOURNAL_NAME, sync_dir=False)
            # Also fsyncs `staging`, making `segments/`, the journal and `lock` durable.
            write_text_atomic(staging / MANIFEST_NAME, manifest.to_json(journal_id=journal_id))
            return manifest, journal_id

        final, manifest, journal_id, lock = self._assemble(
            fill, f"cannot create a conversation in {self.conversations_dir}"
        )
        state = _Journal(final / JOURNAL_NAME, journal_id, 0)
        return Conversation(final, manifest, lock, state)

    def _assemble(
        self, fill: Callable[[Path, str], tuple[Manifest, str]], failure: str
    ) -> tuple[Path, Manifest, str, ConversationLock]:
        """A new conversation under a fresh id: ``fill(staging, id)`` writes its files into a
        hidden ``.creating-*`` folder (``segments/`` and the lock already there) and returns
        its manifest and journal id; the folder is then renamed into place complete, so
        ``list()`` never sees half a conversation. Returns the folder, the manifest, the
        journal id and the lock, still held. ``failure`` starts the message of an OSError."""
        self._sweep()
        for _ in range(50):
            conv_id = _new_id()
            final = self.conversations_dir / conv_id
            if os.path.lexists(final):
                continue
            staging = self.conversations_dir / f"{_CREATING}{conv_id}-{os.getpid()}"
            lock = ConversationLock(staging / LOCK_NAME, conv_id)
            try:
                make_private_dir(staging)  # conversations are private text
                lock.acquire()
                make_private_dir(staging / SEGMENTS_DIR)
                manifest, journal_id = fill(staging, conv_id)
                try:
                    os.rename(staging, final)
                except OSError as e:
                    if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        raise
                    lock.release()
                    shutil.rmtree(staging, ignore_errors=True)
                    continue  # lost a race for this id; draw another
                try:
                    fsync_dir(self.conversations_dir)
                except OSError:
                    pass  # renamed: committed; only durability is in doubt
            except OSError as e:
                lock.release()
                shutil.rmtree(staging, ignore_errors=True)
                raise StorageError(
                    f"{failure} ({one_line(e.strerror or e)}); free disk space or check permissions"
                ) from e
            except BaseException:
                lock.release()
                shutil.rmtree(staging, ignore_errors=True)
                raise
            lock.path = final / LOCK_NAME
            return final, manifest, journal_id, lock
        raise StorageError(  # pragma: no cover - 50 collisions means something else is wrong
            f"cannot find a free conversation id in {self.conversations_dir}; try again"
        )

    def check_not_open(self, conv_id: str) -> str:
        """Resolve ``conv_id`` and fail now (ConversationLockedError) if another process has
        it open, so a caller can refuse before spending seconds loading a model. ``open``
        still takes the lock for real; this check only answers early."""
        cid = self.resolve(conv_id)
        _check_conversation_dir(self.conversations_dir / cid, cid)
        lock = ConversationLock(self.conversations_dir / cid / LOCK_NAME, cid)
        lock.acquire()
        lock.release()
        return cid

    def open(
        self,
        conv_id: str,
        *,
        fingerprint: str | None = None,
        dtype: str | None = None,
        model_name: str | None = None,
        weights: str | None = None,
    ) -> Conversation:
        """Lock and load a conversation by id or unambiguous id prefix.

        With ``fingerprint``/``dtype`` given, refuses a conversation saved with another model
        or dtype: its tensors would be silently wrong for this one (``model_name`` and
        ``weights``, the loaded side, only make the refusal name both sides). Also removes
        debris of an interrupted save (unreferenced segments, temporary files), which is safe
        only now that we hold the lock: that includes a torn record at the journal's end.
        """
        cid = self.resolve(conv_id)
        path = self.conversations_dir / cid
        _check_conversation_dir(path, cid)
        lock = ConversationLock(path / LOCK_NAME, cid)
        lock.acquire()
        try:
            _check_conversation_dir(path, cid)  # again, now that nobody else can change it
            manifest, journal_state = _load(path, cid)
            if journal_state is not None:
                _check_writable_journal(journal_state, cid)
            saved = manifest.model
            wrong_fp = fingerprint is not None and fingerprint != saved.fingerprint
            wrong_dtype = dtype is not None and dtype != saved.dtype
            if wrong_fp or wrong_dtype:
                raise ModelMismatchError(
                    _mismatch_message(
                        cid,
                        manifest,
                        model_name=model_name,
                        fingerprint=fingerprint or saved.fingerprint,
                        dtype=dtype or saved.dtype,
                        weights=weights,
                    )
                )
            _clean_debris(path, manifest, journal_state)
        except BaseException:
            lock.release()
            raise
        if journal_state is not None and journal_state.torn:
            if atomic.truncate_durably(journal_state.path, journal_state.size):
                journal_state = dataclasses.replace(journal_state, torn=0)
        return Conversation(path, manifest, lock, journal_state)

    # -- fork ----------------------------------------------------------------------------

    def fork(self, conv_id: str, *, turn: int | None = None) -> str:
        """A new conversation holding turns 1..``turn`` of ``conv_id`` (default: all of
        them), exactly as that conversation stood after that turn; returns its id.

        The parent is never changed: its lock is held while the fork is made (so it is
        refused, with the usual message, while the parent is open elsewhere), its segments
        are shared by hard links (``branch.share_file``: O(1) disk where the filesystem
        allows, a copy where not), and its journal records up to ``turn`` are resealed for
        the fork's own journal. The fork is assembled in a hidden ``.creating-*`` folder
        and renamed into place complete, like ``create``: a crash leaves the parent as it
        was and at most a folder the next sweep removes.
        """
        with self._locked(conv_id) as (cid, source):
            whole = _load(source, cid)[0]
            total = len(whole.turns)
            upto = total if turn is None else turn
            if not 0 <= upto <= total:
                raise StorageError(
                    f"conversation {cid} has {total} turn(s), so it cannot be forked at turn "
                    f"{upto}; pass --turn between 0 and {total}"
                )
            header, journal_id = _header(source, cid)
            if len(header.turns) > upto:
                raise StorageError(
                    f"the first {len(header.turns)} turns of conversation {cid} were saved by "
                    "an older kvchat, which kept no record of each; fork it at turn "
                    f"{len(header.turns)} or later"
                )
            records: list[dict[str, Any]] = []
            if journal_id is not None:
                at_turn = _load(source, cid, upto=upto, records=records)[0]
            else:
                at_turn = whole
            for t in at_turn.turns:
                segments.check_size(source / SEGMENTS_DIR / t.segment.file, t.segment, cid)
            return self._write_fork(cid, source, header, records, at_turn)

    def turn_messages(self, conv_id: str, turn: int) -> list[dict[str, Any]]:
        """The messages turn ``turn`` of a conversation added (no lock: as ``export``)."""
        cid = self.resolve(conv_id)
        path = self.conversations_dir / cid
        _check_conversation_dir(path, cid)
        whole = _load(path, cid)[0]
        header_turns = self._header_turns(path, cid)
        if not header_turns < turn <= len(whole.turns):
            raise StorageError(
                f"turn {turn} of conversation {cid} has no record of its own messages "
                f"(it has {len(whole.turns)} turn(s)"
                + (f", the first {header_turns} saved by an older kvchat" if header_turns else "")
                + ")"
            )
        before = _load(path, cid, upto=turn - 1)[0]
        after = _load(path, cid, upto=turn)[0]
        return after.messages[len(before.messages) :]

    def message_counts(self, conv_id: str) -> list[int | None]:
        """How many messages the conversation held after each of its turns (no lock: as
        ``export``); None for a turn saved by an older kvchat that kept no count of its own,
        except the last of those. What a server needs to find the turn a request branches at."""
        cid = self.resolve(conv_id)
        path = self.conversations_dir / cid
        _check_conversation_dir(path, cid)
        header, _ = _header(path, cid)
        records: list[dict[str, Any]] = []
        whole = _load(path, cid, records=records)[0]
        counts: list[int | None] = [None] * len(header.turns)
        if counts:
            counts[-1] = len(header.messages)
        seen = len(header.messages)
        for record in records:
            seen += len(record.get("messages") or [])
            counts.append(seen)
        if len(counts) != len(whole.turns):  # a format 1 manifest: all its turns inline
            counts = [None] * (len(whole.turns) - 1) + [len(whole.messages)]
        return counts

    def _header_turns(self, path: Path, cid: str) -> int:
        header, journal_id = _header(path, cid)
        return len(header.turns) if journal_id is not None else 1 << 62

    @contextlib.contextmanager
    def _locked(self, conv_id: str) -> Iterator[tuple[str, Path]]:
        """``(id, folder)`` of a conversation, its lock held and the folder checked again
        once nobody else can change it (what fork and drop_last_turn work under)."""
        cid = self.resolve(conv_id)
        path = self.conversations_dir / cid
        _check_conversation_dir(path, cid)
        lock = ConversationLock(path / LOCK_NAME, cid)
        lock.acquire()
        try:
            _check_conversation_dir(path, cid)
            yield cid, path
        finally:
            lock.release()

    def drop_last_turn(self, conv_id: str) -> int:
        """Remove a conversation's last turn in place (``run --regenerate --in-place``);
        returns the turns left. Its record is cut from the journal first (the commit: the
        conversation is then exactly as it stood before that turn), then its segment goes;
        a crash in between leaves that segment as an interrupted save's debris, removed at
        the next open. Forks keep their own links to it."""
        with self._locked(conv_id) as (cid, path):
            whole, state = _load(path, cid)
            n = len(whole.turns)
            if n == 0 or state is None or self._header_turns(path, cid) >= n:
                raise StorageError(
                    f"conversation {cid} has no turn of its own to drop"
                    + ("" if n == 0 else " (its turns were saved by an older kvchat)")
                    + f"; fork it instead: `kvchat fork {cid}`"
                )
            kept = _load(path, cid, upto=n - 1)[1]
            assert kept is not None
            if not atomic.truncate_durably(state.path, kept.size):
                raise StorageError(
                    f"cannot cut the last turn from {state.path} (the disk refused to make it "
                    f"durable); conversation {cid} may still hold it: run the command again"
                )
            _unlink_quietly(path / SEGMENTS_DIR / whole.turns[-1].segment.file)
            return n - 1

    def _write_fork(
        self,
        parent: str,
        source: Path,
        header: Manifest,
        records: list[dict[str, Any]],
        at_turn: Manifest,
    ) -> str:
        def fill(staging: Path, conv_id: str) -> tuple[Manifest, str]:
            for t in at_turn.turns:
                name = t.segment.file
                share_file(source / SEGMENTS_DIR / name, staging / SEGMENTS_DIR / name)
            fsync_dir(staging / SEGMENTS_DIR)
            now = utc_now()
            fork_header = dataclasses.replace(
                header,
                id=conv_id,
                created=now,
                updated=now,
                format_version=FORMAT_VERSION,
                forked_from=ForkOrigin(parent, len(at_turn.turns)),
            )
            journal_id = journal.new_journal_id()
            lines = b"".join(journal.reseal(r, journal_id) for r in records)
            atomic.write_atomic(staging / JOURNAL_NAME, lines)
            # Also fsyncs `staging`: the journal and `lock` are durable before the rename.
            write_text_atomic(staging / MANIFEST_NAME, fork_header.to_json(journal_id=journal_id))
            return fork_header, journal_id

        final, _, _, lock = self._assemble(
            fill,
            f"cannot fork conversation {parent} in {self.conversations_dir} (the conversation "
            "itself is unchanged)",
        )
        lock.release()
        return final.name

    # -- list / delete / export ----------------------------------------------------------

    def list(self) -> list[ConversationSummary]:
        """Every conversation, most recently used first.

        Reads headers and journals without locking (a header is only ever replaced
        atomically, a journal only appended to: a record being written shows as a torn one,
        which is ignored) and checks segment sizes, not checksums, to stay fast. A
        conversation that cannot be opened is listed with ``error`` set: one bad folder
        never hides the others.
        """
        out = []
        for cid in self._ids():
            out.append(self._summarize(self.conversations_dir / cid, cid))
        out.sort(key=lambda s: (s.last_used, s.id), reverse=True)
        return out

    def summary(self, conv_id: str) -> ConversationSummary:
        """One row of ``list`` (id or unambiguous prefix): what a confirmation shows."""
        cid = self.resolve(conv_id)
        return self._summarize(self.conversations_dir / cid, cid)

    def _summarize(self, path: Path, cid: str) -> ConversationSummary:
        linked = is_symlink(path)
        size, shared = (0, 0) if linked else tree_usage(path)
        try:
            _check_conversation_dir(path, cid)
            manifest = _load(path, cid)[0]
        except StorageError as e:
            try:
                mtime = os.lstat(path).st_mtime
            except OSError:
                mtime = 0.0
            return ConversationSummary(
                id=cid,
                title="",
                model="",
                turns=0,
                tokens=0,
                bytes_on_disk=size,
                last_used=datetime.fromtimestamp(mtime, timezone.utc),
                error=str(e),
            )
        error = None
        for turn in manifest.turns:
            try:
                segments.check_size(path / SEGMENTS_DIR / turn.segment.file, turn.segment, cid)
            except StorageError as e:
                error = str(e)
                break
        # A fork's last record is its parent's; it was last used when it was made.
        last_used = max(_utc(manifest.updated), _utc(manifest.created))
        return ConversationSummary(
            id=cid,
            title=manifest.title,
            model=manifest.model.name,
            turns=len(manifest.turns),
            tokens=len(manifest.token_ids),
            bytes_on_disk=size,
            last_used=last_used,
            error=error,
            forked_from=manifest.forked_from,
            shared_bytes=shared,
        )

    def delete(self, conv_id: str) -> DeleteOutcome:
        """Delete a conversation (id or unambiguous prefix), refusing while it is open.

        Takes the lock itself, so a conversation open anywhere is never pulled from under
        its user. The folder is first renamed to a hidden name, so the conversation vanishes
        at once even if removing its files is slow or interrupted. An entry that is a
        symbolic link loses only the link: what it points at is never touched.
        """
        cid = self.resolve(conv_id)
        path = self.conversations_dir / cid
        if is_symlink(path):
            try:
                os.unlink(path)
            except OSError as e:
                raise StorageError(
                    f"cannot remove the link {path} ({one_line(e.strerror)}); "
                    f"check the permissions of {self.conversations_dir}"
                ) from None
            return DeleteOutcome(cid, link_only=True)
        lock_path = path / LOCK_NAME
        if _planted_lock(lock_path):
            _unlink_quietly(lock_path)  # nobody can hold a lock through it: only its name goes
        lock = ConversationLock(lock_path, cid)
        lock.acquire()
        try:
            trash = self.conversations_dir / f"{_DELETING}{cid}-{secrets.token_hex(4)}"
            try:
                os.rename(path, trash)
            except OSError as e:
                raise StorageError(
                    f"cannot delete conversation {cid} ({one_line(e.strerror)}); "
                    f"check the permissions of {self.conversations_dir}"
                ) from None
            # rmtree never follows links inside the tree: it removes the links themselves.
            shutil.rmtree(trash, ignore_errors=True)
            segments.forget(path)
        finally:
            lock.release()
        return DeleteOutcome(cid, leftover=trash if os.path.lexists(trash) else None)

    def read(self, conv_id: str) -> Manifest:
        """The conversation as its header and journal hold it (messages, settings, model).

        Needs only those two files: no lock (works while the conversation is open elsewhere)
        and no segments (works when a segment is corrupted — the rescue path that error
        messages point to, ``kvchat export``).
        """
        cid = self.resolve(conv_id)
        path = self.conversations_dir / cid
        _check_conversation_dir(path, cid)
        return _load(path, cid)[0]

    # -- housekeeping --------------------------------------------------------------------

    def _sweep(self) -> int:
        """Remove hidden folders left by an interrupted delete or create; returns the bytes
        freed. A ``.creating-`` folder that is locked or younger than a minute may belong to
        a create running in another process right now, and is kept. Leftovers that are links
        lose the link only."""
        try:
            names = os.listdir(self.conversations_dir)
        except OSError:
            return 0
        freed = 0
        for name in names:
            path = self.conversations_dir / name
            if not name.startswith((_DELETING, _CREATING)):
                continue
            if is_symlink(path):
                _unlink_quietly(path)
                continue
            if name.startswith(_CREATING):
                try:
                    if time.time() - os.lstat(path).st_mtime < 60:
                        continue
                except OSError:
                    continue
                lock = ConversationLock(path / LOCK_NAME, name)
                try:
                    lock.acquire()
                except StorageError:
                    continue
                try:
                    freed += _remove_tree(path)
                finally:
                    lock.release()
            else:
                freed += _remove_tree(path)
        return freed

    def sweep_leftovers(self) -> int:
        """Public form of the sweep ``create`` does (for ``kvchat gc``): bytes freed."""
        return self._sweep()


def _utc(stamp: str) -> datetime:
    moment = datetime.fromisoformat(stamp)
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def _planted_lock(path: Path) -> bool:
    """A lock file kvchat refuses to open (a link, a hard link, not a regular file): no
    kvchat process can be holding it."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return not stat.S_ISREG(st.st_mode) or st.st_nlink != 1


def _remove_tree(path: Path) -> int:
    """rmtree, best effort; returns the bytes that are gone."""
    before = tree_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    return before - (tree_bytes(path) if os.path.lexists(path) else 0)


def _mismatch_message(
    cid: str,
    manifest: Manifest,
    *,
    model_name: str | None,
    fingerprint: str,
    dtype: str,
    weights: str | None,
) -> str:
    """Both sides of a refused resume, and what would resume it."""
    saved = manifest.model
    saved_weights = manifest.settings.get("weights")
    if saved_weights is not None:
        saved_weights = safe_terminal_text(str(saved_weights), multiline=False)
    loaded_name = model_name or "the requested model"

    def side(name: str, dt: str, w: str | None, fp: str) -> str:
        w_text = f", weights {w}" if w else ""
        return f"model {name} (dtype {dt}{w_text}, fingerprint {_short(fp)})"

    if fingerprint == saved.fingerprint:
        differs = "the dtype differs"
    elif saved.name == model_name and saved_weights and weights and saved_weights != weights:
        differs = "same model, other weight quantization"
    elif saved.name == model_name:
        differs = "same name, but its files differ from the ones saved with (changed or replaced)"
    else:
        differs = "another model"
    saved_name = safe_terminal_text(saved.name, multiline=False)
    saved_dtype = safe_terminal_text(saved.dtype, multiline=False)
    fix = f"--model {saved_name} --dtype {saved_dtype}"
    if saved_weights:
        fix += f" --weights {saved_weights}"
    was = side(saved_name, saved_dtype, saved_weights, saved.fingerprint)
    return (
        f"conversation {cid} was saved with {was} "
        f"but the loaded one is {side(loaded_name, dtype, weights, fingerprint)}: {differs}; "
        f"resume it with {fix} (the same model files), or start a new conversation"
    )


def _short(fingerprint: str) -> str:
    shown = fingerprint if len(fingerprint) <= 16 else fingerprint[:12] + "…"
    return safe_terminal_text(shown, multiline=False)


def _check_writable_journal(state: _Journal, cid: str) -> None:
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


def _clean_debris(path: Path, manifest: Manifest, journal_state: _Journal | None) -> None:
    """Delete what an interrupted save leaves: temporary files, ``turn-NNNN`` segments no
    record names, and a journal beside a format 1 manifest (an interrupted migration made
    it; the manifest does not use it). Other files are left alone (they are not ours).
    Best effort: debris is harmless, so a failure here must not stop the conversation from
    opening. (A torn record is cut by ``open`` itself.)"""
    referenced = {t.segment.file for t in manifest.turns}
    if journal_state is None and not is_symlink(path / JOURNAL_NAME):
        _unlink_quietly(path / JOURNAL_NAME)
    for directory, holds_segments in ((path, False), (path / SEGMENTS_DIR, True)):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            orphan = holds_segments and bool(SEGMENT_NAME_RE.match(name)) and name not in referenced
            if is_temp_name(name) or orphan:
                _unlink_quietly(directory / name)
                segments.forget(directory / name)
