"""The conversation store: a folder per conversation, a manifest, one segment per turn.

Layout under ``root/conversations/<id>/``::

    manifest.json                   rewritten atomically after every turn
    segments/turn-0001.safetensors  one new file per turn, never rewritten
    lock                            flock target; holds the pid of the process using it

Crash safety rests on one ordering: a turn's segment is written and fsynced *before* the
manifest that names it is atomically replaced. Whatever is interrupted (power, ENOSPC,
Ctrl-C) the manifest on disk is either the old one or the new one, and every segment it names
is complete. Segment files that no manifest names are debris from an interrupted save and are
removed the next time the conversation is opened.

Nothing in the store is followed through a symbolic link: a conversation folder, its
``segments/``, manifest, segments or lock that is a link is refused (``list`` shows it as
an error row, ``open``/``export`` refuse it, ``delete`` removes the link itself and nothing it
points at). Folders are created 0700 and files 0600 whatever the umask: conversations are
private text.

Storage knows files, not models: tensors go in and come out by name; what they mean (residual
checkpoints, chunk boundaries in ``engine_state``) is the engine's business.
"""

from __future__ import annotations

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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvchat.errors import StorageError
from kvchat.storage import segments
from kvchat.storage.atomic import (
    TMP_MARK,
    DirSyncError,
    fsync_dir,
    is_temp_name,
    write_text_atomic,
)
from kvchat.storage.lock import ConversationLock
from kvchat.storage.manifest import (
    SEGMENT_NAME_RE,
    AmbiguousConversationError,
    ConversationNotFoundError,
    Manifest,
    ManifestError,
    ModelInfo,
    ModelMismatchError,
    SaveFailedError,
    Turn,
    UnsafeFileError,
    make_title,
    one_line,
    segment_file_name,
    utc_now,
)
from kvchat.storage.safe_fs import (
    UnsafePathError,
    check_real_dir,
    ensure_private_dirs,
    is_symlink,
    make_private_dir,
    read_regular,
    tree_bytes,
)
from kvchat.storage.text import escape_json_for_terminal, safe_markdown_text, safe_terminal_text

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


def _read_manifest(path: Path, conv_id: str) -> Manifest:
    """Load and validate ``<path>/manifest.json``; every failure is a one-line StorageError."""
    file = path / MANIFEST_NAME
    try:
        raw = read_regular(file)
    except FileNotFoundError:
        raise ManifestError(
            f"manifest {file} of conversation {conv_id} is missing; "
            f"restore it from a backup or run `kvchat delete {conv_id}`"
        ) from None
    except UnsafePathError as e:
        raise ManifestError(
            f"manifest {file} of conversation {conv_id} is refused ({e.strerror}); "
            f"replace it with the real file or run `kvchat delete {conv_id}`"
        ) from None
    except OSError as e:
        raise ManifestError(
            f"manifest {file} of conversation {conv_id} is unreadable ({one_line(e.strerror)}); "
            "check the file's permissions and the disk"
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError(
            f"manifest {file} of conversation {conv_id} is not valid UTF-8 text; "
            f"restore it from a backup or run `kvchat delete {conv_id}`"
        ) from None
    manifest = Manifest.from_json(text, source=file, conv_id=conv_id)
    # The folder name is the id users type; a folder copied under another name still opens.
    manifest.id = conv_id
    return manifest


class Conversation:
    """An open conversation, locked for this handle until ``close()``.

    Use as a context manager. Methods are safe to call from several threads, but the object
    is meant for one engine session.
    """

    def __init__(self, path: Path, manifest: Manifest, lock: ConversationLock) -> None:
        self.path = Path(path)
        self.id = self.path.name
        self.manifest = manifest
        self._lock = lock
        self._mutex = threading.RLock()

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

        Order: segment written and fsynced, then the manifest atomically replaced. Until that
        replace, the on-disk conversation is exactly the previous turn; so on any failure it
        still is. OSErrors (disk full...) become SaveFailedError; KeyboardInterrupt is
        re-raised after the same cleanup. ``self.manifest`` only changes once the new manifest
        is on disk, so a failed call can simply be retried.
        """
        with self._mutex:
            self._check_open()
            new_messages = _json_copy(messages, "messages")
            if not isinstance(new_messages, list) or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in new_messages
            ):
                raise TypeError("messages must be a list of {'role': str, 'content': str} dicts")
            if any(isinstance(t, bool) for t in token_ids):
                raise TypeError("token_ids must be ints, not bools")
            # operator.index accepts Python, numpy and 0-d torch integers and refuses floats.
            new_ids = [operator.index(t) for t in token_ids]
            extra_copy = _json_dict(extra or {}, "extra")
            state = (
                self.manifest.engine_state
                if engine_state is None
                else _json_dict(engine_state, "engine_state")
            )

            streamed = any(isinstance(t, segments.StreamedTensor) for t in tensors.values())
            if streamed:
                data = None
                info = segments.SegmentInfo(file="", sha256="", nbytes=0)
            else:
                data, info = segments.encode(tensors)
            old = self.manifest
            index = len(old.turns) + 1
            info.file = segment_file_name(index)
            all_messages = old.messages + new_messages
            all_ids = old.token_ids + new_ids
            title = old.title
            if not title:
                first_user = next((m for m in all_messages if m["role"] == "user"), None)
                title = make_title(first_user["content"]) if first_user else ""
            new = dataclasses.replace(
                old,
                title=title,
                updated=utc_now(),
                messages=all_messages,
                token_ids=all_ids,
                turns=[*old.turns, Turn(index, len(all_ids), info, extra_copy)],
                engine_state=state,
            )
            text = new.to_json()

            seg_path = self.path / SEGMENTS_DIR / info.file
            try:
                if streamed:
                    written = segments.write_segment_stream(seg_path, tensors)
                    info.sha256, info.nbytes = written.sha256, written.nbytes
                    text = new.to_json()
                else:
                    segments.write_segment(seg_path, data)
                try:
                    write_text_atomic(self.path / MANIFEST_NAME, text)
                except DirSyncError:
                    pass  # renamed into place: committed; only its durability is in doubt
            except OSError as e:
                if not self._settle_failed_save(seg_path, new, text):
                    raise SaveFailedError(self._save_failed_message(index, e)) from e
            except BaseException:
                self._settle_failed_save(seg_path, new, text)
                raise
            segments.remember(seg_path, info.sha256)
            self.manifest = new

    def staging_path(self, index: int) -> Path:
        """Where a rebuilt segment of turn ``index`` is written before it replaces the old
        one: a temporary name, so a crash leaves debris that the next open sweeps."""
        name = self._turn(index).segment.file
        return self.path / SEGMENTS_DIR / f".{name}{TMP_MARK}repair-{os.getpid()}"

    def replace_segments(self, staged: Mapping[int, segments.SegmentInfo]) -> None:
        """Put rebuilt segments (written at ``staging_path(index)``, described by ``staged``)
        in place of turns' segments, and record their checksums.

        Each file is renamed over the old one, then the manifest is replaced. A crash
        between the two leaves a segment that fails its old checksum: the conversation then
        reads as damaged at that turn, and a repair run again fixes it.
        """
        with self._mutex:
            self._check_open()
            infos = {}
            for index, info in staged.items():
                target = self._turn(index).segment.file
                infos[index] = segments.SegmentInfo(target, info.sha256, info.nbytes)
            turns = [
                dataclasses.replace(t, segment=infos[t.index]) if t.index in infos else t
                for t in self.manifest.turns
            ]
            new = dataclasses.replace(self.manifest, turns=turns, updated=utc_now())
            text = new.to_json()
            try:
                for index in infos:
                    final = self.path / SEGMENTS_DIR / infos[index].file
                    segments.forget(final)
                    os.replace(self.staging_path(index), final)
                fsync_dir(self.path / SEGMENTS_DIR)
                try:
                    write_text_atomic(self.path / MANIFEST_NAME, text)
                except DirSyncError:
                    pass  # renamed into place: committed
            except OSError as e:
                raise SaveFailedError(
                    f"rebuilding conversation {self.id} failed while replacing its segments "
                    f"({one_line(e.strerror or e)}); check the disk and run the repair again"
                ) from e
            for info in infos.values():
                segments.remember(self.path / SEGMENTS_DIR / info.file, info.sha256)
            self.manifest = new

    def _settle_failed_save(self, seg_path: Path, new: Manifest, text: str) -> bool:
        """After an interrupted save, find out whether the new manifest made it to disk.

        If it did (an interrupt landed just after the rename) adopt it; otherwise delete the
        now-unreferenced segment. If we cannot tell, touch nothing: open() cleans up.
        Returns True when the save is in fact committed.
        """
        try:
            on_disk = (self.path / MANIFEST_NAME).read_text("utf-8")
        except (OSError, ValueError):
            return False
        if on_disk == text:
            self.manifest = new
            return True
        _unlink_quietly(seg_path)
        segments.forget(seg_path)
        return False

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
        so ``list()`` never sees a conversation without a manifest.
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
                now = utc_now()
                manifest = Manifest(
                    id=conv_id,
                    title="",
                    created=now,
                    updated=now,
                    model=ModelInfo(name=model_name, fingerprint=fingerprint, dtype=dtype),
                    settings=settings,
                )
                # Also fsyncs `staging`, making `segments/` and `lock` durable with it.
                write_text_atomic(staging / MANIFEST_NAME, manifest.to_json())
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
                    f"cannot create a conversation in {self.conversations_dir} "
                    f"({one_line(e.strerror or e)}); free disk space or check permissions"
                ) from e
            except BaseException:
                lock.release()
                shutil.rmtree(staging, ignore_errors=True)
                raise
            lock.path = final / LOCK_NAME
            return Conversation(final, manifest, lock)
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
        only now that we hold the lock.
        """
        cid = self.resolve(conv_id)
        path = self.conversations_dir / cid
        _check_conversation_dir(path, cid)
        lock = ConversationLock(path / LOCK_NAME, cid)
        lock.acquire()
        try:
            _check_conversation_dir(path, cid)  # again, now that nobody else can change it
            manifest = _read_manifest(path, cid)
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
            _clean_debris(path, manifest)
        except BaseException:
            lock.release()
            raise
        return Conversation(path, manifest, lock)

    # -- list / delete / export ----------------------------------------------------------

    def list(self) -> list[ConversationSummary]:
        """Every conversation, most recently used first.

        Reads manifests without locking (they are only ever replaced atomically) and checks
        segment sizes, not checksums, to stay fast. A conversation that cannot be opened is
        listed with ``error`` set: one bad folder never hides the others.
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
        size = 0 if linked else tree_bytes(path)
        try:
            _check_conversation_dir(path, cid)
            manifest = _read_manifest(path, cid)
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
        last_used = datetime.fromisoformat(manifest.updated)
        if last_used.tzinfo is None:
            last_used = last_used.replace(tzinfo=timezone.utc)
        return ConversationSummary(
            id=cid,
            title=manifest.title,
            model=manifest.model.name,
            turns=len(manifest.turns),
            tokens=len(manifest.token_ids),
            bytes_on_disk=size,
            last_used=last_used,
            error=error,
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

    def export(self, conv_id: str, fmt: Literal["md", "json"] = "md") -> str:
        """The conversation's text as Markdown or JSON.

        Needs only the manifest: no lock (works while the conversation is open elsewhere)
        and no segments (works when a segment is corrupted — the rescue path that error
        messages point to).
        """
        if fmt not in ("md", "json"):
            raise ValueError(f"export format must be 'md' or 'json', not {fmt!r}")
        cid = self.resolve(conv_id)
        path = self.conversations_dir / cid
        _check_conversation_dir(path, cid)
        m = _read_manifest(path, cid)
        if fmt == "json":
            doc = {
                "id": m.id,
                "title": m.title,
                "created": m.created,
                "updated": m.updated,
                "model": {"name": m.model.name, "dtype": m.model.dtype},
                "settings": m.settings,
                "messages": m.messages,
            }
            return escape_json_for_terminal(json.dumps(doc, indent=2, ensure_ascii=False)) + "\n"

        def one(text: str) -> str:
            return safe_markdown_text(text, multiline=False)

        lines = [
            f"# {one(m.title) or 'Untitled conversation'}",
            "",
            f"- id: `{m.id}`",
            f"- model: {one(m.model.name)} ({one(m.model.dtype)})",
            f"- created: {one(m.created)}",
            f"- updated: {one(m.updated)}",
        ]
        for msg in m.messages:
            role = one(msg["role"].capitalize())
            lines += ["", f"## {role}", "", safe_markdown_text(msg["content"].rstrip("\n"))]
        return "\n".join(lines) + "\n"

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


def _clean_debris(path: Path, manifest: Manifest) -> None:
    """Delete what an interrupted save leaves: temporary files, and ``turn-NNNN`` segments
    the manifest does not name. Other files are left alone (they are not ours). Best effort:
    debris is harmless, so a failure here must not stop the conversation from opening."""
    referenced = {t.segment.file for t in manifest.turns}
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
