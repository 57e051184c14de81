"""The conversation manifest: what a conversation holds, and its header file.

In memory a ``Manifest`` is everything about a conversation except the tensors. On disk
(format 2) it is split: ``manifest.json``, the header, is a manifest as it stood when it was
written (at create: no turns; after migrating an old conversation: all of its turns) plus the
``journal_id`` of the journal that continues it, and ``journal.jsonl`` holds one record per
turn saved since (see ``journal``). The header is written once, atomically; a turn is saved
by appending its record. Format 1, one ``manifest.json`` holding every turn and rewritten
after each, is still read; its next save rewrites it as a format 2 header.

The manifest is the single source of truth for a conversation. Segment files on disk that it
does not name do not exist as far as kvchat is concerned (they are leftovers of an interrupted
save), which is what makes a save atomic: a turn's record (or, for format 1, the manifest) is
committed only after its segment is safely on disk.

Edits made outside kvchat are detected: the header carries a ``checksum`` over its content
(canonical JSON, so re-indenting the file is not an edit), and the token counts of the turns
must add up to the token ids. This catches hand edits and damage, not forgery: anyone who can
write the file can recompute a sha256. A format 1 manifest without ``checksum`` (older kvchat)
is accepted and gets one at its next save; a format 2 header must have one.

The storage error classes live here too, because every other storage module already depends
on this one and none of them may depend on ``store``. Every message is one line addressed to
the user, names the conversation or file, and says what to do.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvchat.errors import StorageError
from kvchat.units import one_line

FORMAT_VERSION = 2
"""Bump when a reader of the old format would misread the new one (not for new optional keys).
2: header + journal; 1: one manifest.json with every turn (still read)."""

TITLE_MAX_CHARS = 60

CHECKSUM_KEY = "checksum"

JOURNAL_ID_KEY = "journal_id"
JOURNAL_ID_RE = re.compile(r"^[0-9a-f]{16}$")

SEGMENT_NAME_RE = re.compile(r"^turn-(\d{4,})\.safetensors$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


# --------------------------------------------------------------------------- errors


class ConversationNotFoundError(StorageError):
    """No conversation has that id (or id prefix)."""


class AmbiguousConversationError(StorageError):
    """An id prefix matches more than one conversation."""


class ManifestError(StorageError):
    """manifest.json is missing, not JSON, or does not have the expected structure."""


class ManifestEditedError(ManifestError):
    """manifest.json was changed outside kvchat: its checksum does not match its content."""


class NewerFormatError(StorageError):
    """The conversation was written by a newer kvchat whose format this one cannot read."""


class ModelMismatchError(StorageError):
    """The conversation was saved with another model or dtype than the one asked for."""


class SegmentCorruptedError(StorageError):
    """A segment file is missing, truncated, or fails its checksum."""


class ConversationLockedError(StorageError):
    """Another process (or another handle in this one) has the conversation open."""


class UnsafeFileError(StorageError):
    """A conversation folder, or a file in it, is a symbolic link or not a regular file:
    refused, never followed (a folder copied from someone else must not reach other files)."""


class SaveFailedError(StorageError):
    """Writing a turn failed (disk full, I/O error); the previous turn is still on disk."""


# --------------------------------------------------------------------------- dataclasses


@dataclass
class ModelInfo:
    """Which model produced the saved tensors; they are only valid for that exact model."""

    name: str
    fingerprint: str
    dtype: str


@dataclass
class SegmentInfo:
    """One turn's safetensors file: its name inside ``segments/`` plus what it must hash to."""

    file: str
    sha256: str
    nbytes: int


@dataclass
class Turn:
    """One saved turn. ``index`` starts at 1 and matches the ``turn-NNNN`` file name."""

    index: int
    n_tokens_total_after: int
    segment: SegmentInfo
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ForkOrigin:
    """Where a fork came from: conversation ``id`` as it stood after turn ``turn``. Only a
    record: the fork holds its own links to those turns' segments and never reads the parent."""

    id: str
    turn: int


@dataclass
class Manifest:
    """Everything about a conversation except the tensors themselves."""

    id: str
    title: str
    created: str
    updated: str
    model: ModelInfo
    settings: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    engine_state: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    forked_from: ForkOrigin | None = None

    # -- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict, keys in a stable, human-friendly order."""
        return {
            "format_version": self.format_version,
            "id": self.id,
            "title": self.title,
            "created": self.created,
            "updated": self.updated,
            "model": {
                "name": self.model.name,
                "fingerprint": self.model.fingerprint,
                "dtype": self.model.dtype,
            },
            "settings": self.settings,
            "messages": self.messages,
            "token_ids": self.token_ids,
            "turns": [
                {
                    "index": t.index,
                    "n_tokens_total_after": t.n_tokens_total_after,
                    "segment": {
                        "file": t.segment.file,
                        "sha256": t.segment.sha256,
                        "nbytes": t.segment.nbytes,
                    },
                    "extra": t.extra,
                }
                for t in self.turns
            ],
            "engine_state": self.engine_state,
            # Only when set, so the checksum of every header written before forks stays valid.
            **(
                {"forked_from": {"id": self.forked_from.id, "turn": self.forked_from.turn}}
                if self.forked_from is not None
                else {}
            ),
        }

    def to_json(self, *, journal_id: str | None = None) -> str:
        """Readable JSON: objects and lists of objects indented, but lists of plain values
        (``token_ids``, chunk boundaries) on one line: one int per line would bury the rest
        of the file under thousands of lines. With ``journal_id``: the format 2 header that
        the journal of that id continues."""
        data = self.to_dict()
        if journal_id is not None:
            data[JOURNAL_ID_KEY] = journal_id
        data[CHECKSUM_KEY] = content_checksum(data)
        return _pretty(data) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str | Path, conv_id: str) -> Manifest:
        """Parse and validate. ``source`` and ``conv_id`` only feed the error messages."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting
            raise ManifestError(
                f"manifest {source} of conversation {conv_id} is not valid JSON "
                f"({one_line(e)}); restore it from a backup or run `kvchat delete {conv_id}`"
            ) from None
        return cls.from_dict(data, source=source, conv_id=conv_id)

    @classmethod
    def from_dict(cls, data: Any, *, source: str | Path, conv_id: str) -> Manifest:
        """Build from parsed JSON, checking every field so a damaged file fails here, once,
        with a message naming the file, instead of deep inside the engine."""

        def bad(what: str) -> ManifestError:
            return ManifestError(
                f"manifest {source} of conversation {conv_id} is damaged ({one_line(what)}); "
                f"restore it from a backup or run `kvchat delete {conv_id}`"
            )

        if not isinstance(data, dict):
            raise bad("top level is not an object")
        check_format_version(data.get("format_version"), conv_id=conv_id, bad=bad)

        def get(obj: dict[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
            return checked_field(obj, key, typ, where, bad)

        model = get(data, "model", dict, "")
        messages = get(data, "messages", list, "")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                raise bad(f"messages[{i}] is not an object")
            get(msg, "role", str, f"messages[{i}].")
            get(msg, "content", str, f"messages[{i}].")
        token_ids = get(data, "token_ids", list, "")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise bad("token_ids holds a non-integer")

        turns = []
        for i, raw in enumerate(get(data, "turns", list, "")):
            where = f"turns[{i}]."
            if not isinstance(raw, dict):
                raise bad(f"turns[{i}] is not an object")
            seg = get(raw, "segment", dict, where)
            turn = Turn(
                index=get(raw, "index", int, where),
                n_tokens_total_after=get(raw, "n_tokens_total_after", int, where),
                segment=SegmentInfo(
                    file=get(seg, "file", str, where + "segment."),
                    sha256=get(seg, "sha256", str, where + "segment."),
                    nbytes=get(seg, "nbytes", int, where + "segment."),
                ),
                extra=get(raw, "extra", dict, where) if "extra" in raw else {},
            )
            if turn.index != i + 1:
                raise bad(f"{where}index is {turn.index}, expected {i + 1}")
            if turn.segment.file != segment_file_name(turn.index):
                raise bad(f"{where}segment.file is {turn.segment.file!r}")
            if not SHA256_RE.match(turn.segment.sha256):
                raise bad(f"{where}segment.sha256 is not a sha256 hex digest")
            if turn.segment.nbytes < 0:
                raise bad(f"{where}segment.nbytes is negative")
            previous = turns[-1].n_tokens_total_after if turns else 0
            if not previous <= turn.n_tokens_total_after <= len(token_ids):
                raise bad(f"{where}n_tokens_total_after is out of order or past token_ids")
            turns.append(turn)

        checksum = data.get(CHECKSUM_KEY)
        try:
            edited = checksum is not None and checksum != content_checksum(data)
        except (RecursionError, ValueError):
            raise bad("nested too deeply") from None
        if edited:
            raise ManifestEditedError(
                f"manifest {source} of conversation {conv_id} was changed outside kvchat (its "
                "checksum no longer matches its content); undo the edit or restore the file "
                f"from a backup, or run `kvchat delete {conv_id}`"
            )
        # Every saved turn records the token count after it, so the ids must end there.
        ends_at = turns[-1].n_tokens_total_after if turns else 0
        if len(token_ids) != ends_at:
            raise bad(f"token_ids holds {len(token_ids)} ids but the saved turns end at {ends_at}")

        for key in ("created", "updated"):
            try:
                datetime.fromisoformat(get(data, key, str, ""))
            except ValueError:
                raise bad(f"{key} is not an ISO-8601 time") from None

        forked_from = None
        if "forked_from" in data:
            origin = get(data, "forked_from", dict, "")
            forked_from = ForkOrigin(
                id=get(origin, "id", str, "forked_from."),
                turn=get(origin, "turn", int, "forked_from."),
            )
        return cls(
            forked_from=forked_from,
            format_version=data["format_version"],
            id=get(data, "id", str, ""),
            title=get(data, "title", str, ""),
            created=data["created"],
            updated=data["updated"],
            model=ModelInfo(
                name=get(model, "name", str, "model."),
                fingerprint=get(model, "fingerprint", str, "model."),
                dtype=get(model, "dtype", str, "model."),
            ),
            settings=get(data, "settings", dict, ""),
            messages=messages,
            token_ids=token_ids,
            turns=turns,
            engine_state=get(data, "engine_state", dict, "") if "engine_state" in data else {},
        )


def parse_header(text: str, *, source: str | Path, conv_id: str) -> tuple[Manifest, str | None]:
    """A ``manifest.json`` of either format: the manifest it holds, and for format 2 the
    id of the journal that continues it (None for format 1, which holds every turn)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ManifestError(
            f"manifest {source} of conversation {conv_id} is not valid JSON "
            f"({one_line(e)}); restore it from a backup or run `kvchat delete {conv_id}`"
        ) from None
    manifest = Manifest.from_dict(data, source=source, conv_id=conv_id)
    if manifest.format_version < 2:
        return manifest, None
    if CHECKSUM_KEY not in data:
        raise ManifestEditedError(
            f"manifest {source} of conversation {conv_id} was changed outside kvchat (it has "
            "no checksum); undo the edit or restore the file from a backup, "
            f"or run `kvchat delete {conv_id}`"
        )
    journal_id = data.get(JOURNAL_ID_KEY)
    if not isinstance(journal_id, str) or not JOURNAL_ID_RE.match(journal_id):
        raise ManifestError(
            f"manifest {source} of conversation {conv_id} is damaged ({JOURNAL_ID_KEY} "
            f"missing or not 16 hex digits); restore it from a backup or run "
            f"`kvchat delete {conv_id}`"
        )
    return manifest, journal_id


def checked_field(
    obj: dict[str, Any],
    key: str,
    typ: type | tuple[type, ...],
    where: str,
    bad: Callable[[str], Exception],
) -> Any:
    """``obj[key]``, which must be a ``typ`` (a bool is not an int); else ``bad(why)`` is
    raised, ``why`` naming the field as ``where + key``."""
    if key not in obj:
        raise bad(f"{where}{key} missing")
    value = obj[key]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise bad(f"{where}{key} has the wrong type")
    return value


def content_checksum(data: dict[str, Any]) -> str:
    """``sha256:<hex>`` of a manifest's content (every key but the checksum), in canonical
    JSON: key order, spacing and escapes do not change it, any value does."""
    body = {k: v for k, v in data.items() if k != CHECKSUM_KEY}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _pretty(value: Any, level: int = 0) -> str:
    def scalar(v: Any) -> str:
        return json.dumps(v, ensure_ascii=False, allow_nan=False)

    pad, end = "  " * (level + 1), "  " * level
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{pad}{scalar(str(k))}: {_pretty(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(value, (list, tuple)):
        if all(not isinstance(v, (dict, list, tuple)) for v in value):
            return "[" + ",".join(scalar(v) for v in value) + "]"
        items = [pad + _pretty(v, level + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + end + "]"
    return scalar(value)


def check_format_version(version: Any, *, conv_id: str, bad: Any = None) -> None:
    """Refuse a manifest from a newer kvchat before looking at anything else in it: its other
    fields may mean something this version does not know."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        if bad is not None:
            raise bad("format_version missing or not a positive integer")
        raise ManifestError(f"conversation {conv_id} has no valid format_version")
    if version > FORMAT_VERSION:
        raise NewerFormatError(
            f"conversation {conv_id} was saved by a newer kvchat "
            f"(format {version} > {FORMAT_VERSION}); upgrade kvchat to open it"
        )


def segment_file_name(index: int) -> str:
    """``turn-0003.safetensors``: zero-padded so a plain ``ls`` lists turns in order."""
    return f"turn-{index:04d}.safetensors"


def utc_now() -> str:
    """ISO-8601 UTC with an explicit offset (``+00:00`` parses on Python 3.10, ``Z`` not)."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def make_title(text: str) -> str:
    """First user message as a one-line title of at most TITLE_MAX_CHARS characters."""
    text = one_line(text)
    if len(text) <= TITLE_MAX_CHARS:
        return text
    return text[: TITLE_MAX_CHARS - 1].rstrip() + "…"
