"""The conversation store: finding conversations, and creating, opening, forking, listing
and deleting them. A folder per conversation, a header, a journal, one segment per turn
(``folder`` reads them, ``conversation`` saves turns into an open one, ``legacy`` handles the
old one-file format).

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
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvchat.errors import StorageError
from kvchat.storage import atomic, journal, segments
from kvchat.storage.atomic import fsync_dir, write_text_atomic
from kvchat.storage.branch import share_file
from kvchat.storage.conversation import Conversation, json_dict
from kvchat.storage.folder import (
    LOCK_NAME,
    MANIFEST_NAME,
    SEGMENTS_DIR,
    JournalEnd,
    check_conversation_dir,
    check_writable_journal,
    clean_debris,
    load_folder,
    read_header,
    unlink_quietly,
)
from kvchat.storage.journal import JOURNAL_NAME
from kvchat.storage.lock import ConversationLock
from kvchat.storage.manifest import (
    FORMAT_VERSION,
    AmbiguousConversationError,
    ConversationNotFoundError,
    ForkOrigin,
    Manifest,
    ModelInfo,
    ModelMismatchError,
    one_line,
    utc_now,
)
from kvchat.storage.safe_fs import (
    ensure_private_dirs,
    is_symlink,
    make_private_dir,
    tree_bytes,
    tree_usage,
)
from kvchat.storage.text import safe_terminal_text

__all__ = ["Conversation", "ConversationStore", "ConversationSummary", "DeleteOutcome"]

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


def _new_id() -> str:
    """``20261130-024512-3fa2``: UTC creation time (so ids sort by age) plus 16 random bits
    (so two conversations created in the same second do not collide)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(2)}"


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
        settings = json_dict(settings, "settings")
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
        state = JournalEnd(final / JOURNAL_NAME, journal_id, 0)
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
        check_conversation_dir(self.conversations_dir / cid, cid)
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
        check_conversation_dir(path, cid)
        lock = ConversationLock(path / LOCK_NAME, cid)
        lock.acquire()
        try:
            check_conversation_dir(path, cid)  # again, now that nobody else can change it
            manifest, journal_state = load_folder(path, cid)
            if journal_state is not None:
                check_writable_journal(journal_state, cid)
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
            clean_debris(path, manifest, journal_state)
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
            whole = load_folder(source, cid)[0]
            total = len(whole.turns)
            upto = total if turn is None else turn
            if not 0 <= upto <= total:
                raise StorageError(
                    f"conversation {cid} has {total} turn(s), so it cannot be forked at turn "
                    f"{upto}; pass --turn between 0 and {total}"
                )
            header, journal_id = read_header(source, cid)
            if len(header.turns) > upto:
                raise StorageError(
                    f"the first {len(header.turns)} turns of conversation {cid} were saved by "
                    "an older kvchat, which kept no record of each; fork it at turn "
                    f"{len(header.turns)} or later"
                )
            records: list[dict[str, Any]] = []
            if journal_id is not None:
                at_turn = load_folder(source, cid, upto=upto, records=records)[0]
            else:
                at_turn = whole
            for t in at_turn.turns:
                segments.check_size(source / SEGMENTS_DIR / t.segment.file, t.segment, cid)
            return self._write_fork(cid, source, header, records, at_turn)

    def turn_messages(self, conv_id: str, turn: int) -> list[dict[str, Any]]:
        """The messages turn ``turn`` of a conversation added (no lock: as ``export``)."""
        cid = self.resolve(conv_id)
        path = self.conversations_dir / cid
        check_conversation_dir(path, cid)
        whole = load_folder(path, cid)[0]
        header_turns = self._header_turns(path, cid)
        if not header_turns < turn <= len(whole.turns):
            raise StorageError(
                f"turn {turn} of conversation {cid} has no record of its own messages "
                f"(it has {len(whole.turns)} turn(s)"
                + (f", the first {header_turns} saved by an older kvchat" if header_turns else "")
                + ")"
            )
        before = load_folder(path, cid, upto=turn - 1)[0]
        after = load_folder(path, cid, upto=turn)[0]
        return after.messages[len(before.messages) :]

    def message_counts(self, conv_id: str) -> list[int | None]:
        """How many messages the conversation held after each of its turns (no lock: as
        ``export``); None for a turn saved by an older kvchat that kept no count of its own,
        except the last of those. What a server needs to find the turn a request branches at."""
        cid = self.resolve(conv_id)
        path = self.conversations_dir / cid
        check_conversation_dir(path, cid)
        header, _ = read_header(path, cid)
        records: list[dict[str, Any]] = []
        whole = load_folder(path, cid, records=records)[0]
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
        header, journal_id = read_header(path, cid)
        return len(header.turns) if journal_id is not None else 1 << 62

    @contextlib.contextmanager
    def _locked(self, conv_id: str) -> Iterator[tuple[str, Path]]:
        """``(id, folder)`` of a conversation, its lock held and the folder checked again
        once nobody else can change it (what fork and drop_last_turn work under)."""
        cid = self.resolve(conv_id)
        path = self.conversations_dir / cid
        check_conversation_dir(path, cid)
        lock = ConversationLock(path / LOCK_NAME, cid)
        lock.acquire()
        try:
            check_conversation_dir(path, cid)
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
            whole, state = load_folder(path, cid)
            n = len(whole.turns)
            if n == 0 or state is None or self._header_turns(path, cid) >= n:
                raise StorageError(
                    f"conversation {cid} has no turn of its own to drop"
                    + ("" if n == 0 else " (its turns were saved by an older kvchat)")
                    + f"; fork it instead: `kvchat fork {cid}`"
                )
            kept = load_folder(path, cid, upto=n - 1)[1]
            assert kept is not None
            if not atomic.truncate_durably(state.path, kept.size):
                raise StorageError(
                    f"cannot cut the last turn from {state.path} (the disk refused to make it "
                    f"durable); conversation {cid} may still hold it: run the command again"
                )
            unlink_quietly(path / SEGMENTS_DIR / whole.turns[-1].segment.file)
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
            check_conversation_dir(path, cid)
            manifest = load_folder(path, cid)[0]
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
            unlink_quietly(lock_path)  # nobody can hold a lock through it: only its name goes
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
        check_conversation_dir(path, cid)
        return load_folder(path, cid)[0]

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
                unlink_quietly(path)
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
