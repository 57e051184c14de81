"""An open conversation: the commit protocol of a save, and reading its turns back.

Crash safety rests on one ordering: a turn's segment is written and fsynced *before* the
record that names it is appended and fsynced, and that fsync is the commit. Whatever is
interrupted (power, ENOSPC, Ctrl-C) the journal holds every earlier record whole, plus at
most a torn last one that readers ignore; every segment a record names is complete. A failed
append is cut back before its segment is deleted, and a segment is kept if that cut cannot
be made durable (the record might survive a power cut). See ``journal`` for the record
format and why it is a journal, ``legacy`` for the first save of a format 1 conversation.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import operator
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvchat.storage import atomic, journal, legacy, segments
from kvchat.storage.atomic import TMP_MARK, DirSyncError, fsync_dir, write_text_atomic
from kvchat.storage.folder import MANIFEST_NAME, SEGMENTS_DIR, JournalEnd, unlink_quietly
from kvchat.storage.lock import ConversationLock
from kvchat.storage.manifest import (
    FORMAT_VERSION,
    Manifest,
    SaveFailedError,
    Turn,
    make_title,
    one_line,
    segment_file_name,
    utc_now,
)
from kvchat.storage.safe_fs import open_regular

if TYPE_CHECKING:  # tensors pass through the store by name; torch is imported where used
    import torch


def _json_copy(value: Any, what: str) -> Any:
    """Deep copy through JSON: proves now, before any file is touched, that the value can be
    saved, and detaches it from the caller's later mutations."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serialisable: {e}") from None


def json_dict(value: Any, what: str) -> dict[str, Any]:
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
class SaveTimes:
    """Where a save's time went: encoding and writing the turn's segment, then committing
    it (the journal record, or a format 1 conversation's new header)."""

    segment_seconds: float
    commit_seconds: float


@dataclass(frozen=True)
class _Saved:
    """What is on disk: the manifest, and where the journal ends (the next record's offset)."""

    manifest: Manifest
    journal: JournalEnd | None


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
    journal: JournalEnd | None = None  # where the journal ends once this save commits
    record: bytes = b""
    header: str = ""
    progress: atomic.AppendProgress = dataclasses.field(default_factory=atomic.AppendProgress)


class Conversation:
    """An open conversation, locked for this handle until ``close()``.

    Use as a context manager. Methods are safe to call from several threads, but the object
    is meant for one engine session.
    """

    def __init__(
        self, path: Path, manifest: Manifest, lock: ConversationLock, journal: JournalEnd | None
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
    ) -> SaveTimes:
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
            extra_copy = json_dict(extra or {}, "extra")
            old = self._saved.manifest
            state = (
                old.engine_state
                if engine_state is None
                else json_dict(engine_state, "engine_state")
            )
            started = time.perf_counter()
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
                segment_done = time.perf_counter()
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
            else:
                return SaveTimes(segment_done - started, time.perf_counter() - segment_done)
            return SaveTimes(0.0, time.perf_counter() - started)  # committed after all

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
        """First save of a format 1 conversation (see ``legacy``): the whole manifest, this
        turn included, becomes a format 2 header, committed once it is renamed into place."""
        old = self._saved.manifest
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
        save.header, save.journal = legacy.begin_migration(self.path, whole)
        legacy.commit_migration(self.path, save.header)

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
            unlink_quietly(save.seg_path)
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
