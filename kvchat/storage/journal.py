"""The conversation journal: ``journal.jsonl``, one self-checksummed record per saved turn.

Why a journal and not one manifest rewritten per turn: rewriting (and fsyncing) every message,
token id and per-turn extra at each turn makes saving turn 200 cost 200 turns. Here a save
appends what the turn *added* and fsyncs that; the header (``manifest.json``, see
``manifest``) is written at create and never again, except once to migrate a conversation of
the old format. Why not SQLite (as Simon Willison's ``llm`` does): its transactions would
give the same guarantee, but the files would stop being readable text, the store's
link/FIFO/hard-link refusals (``safe_fs``) could not be applied to files SQLite opens itself,
and its -wal/-journal companions would be more files to keep private and sweep. A line of
JSON appended and fsynced needs none of that, and a crash can only tear its last line.

A record is one line of compact JSON (``jq`` reads it), whose last key is ``checksum``: the
sha256 of the line's bytes without that key. It holds the turn's index, its segment, the new
messages and token ids, its ``extra``, what changed in ``engine_state`` (a delta: the engine
hands over the whole state each turn, including its rendered prompt, which grows with the
conversation; a string that only grew is saved as what it gained), the token count after it,
the title and the save time (so a summary reads the last record, not a recomputation), and
the ``journal_id`` of the header it continues, so a journal never continues another header.

Reading rules, so that a crash is never misread and an edit never silently dropped:

* the commit point of a save is the fsync of its record; the record's newline is its last
  byte, so bytes after the last newline are an interrupted save's torn record: ignored by
  readers, cut away by the next open or save (which hold the lock);
* so is a last line holding NUL bytes: filesystems that extend a file before its data lands
  show zeros there, and JSON never contains a raw NUL;
* any other line that fails its checksum, wherever it is, is an edit or damage and refuses
  the conversation (``ManifestEditedError``); a resealed line that does not fit (wrong turn,
  token counts that do not add up...) is ``ManifestError``;
* a journal ending before a turn whose segment exists has lost whole records (a truncated
  copy): refused, so that the segments of those turns are never swept as debris.

The checksum is over the line's bytes, not canonical JSON: verifying it costs a hash, not a
parse, and a journal line is not something an editor reflows. Like the header's, it catches
edits and damage, not forgery.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kvchat.storage.manifest import (
    CHECKSUM_KEY,
    SHA256_RE,
    Manifest,
    ManifestEditedError,
    ManifestError,
    SegmentInfo,
    Turn,
    checked_field,
    one_line,
    segment_file_name,
)

JOURNAL_NAME = "journal.jsonl"

_SEAL = re.compile(rb',"' + CHECKSUM_KEY.encode() + rb'":"sha256:([0-9a-f]{64})"\}\Z')


def reseal(record: dict[str, Any], journal_id: str) -> bytes:
    """A record read from one journal (checksum stripped), sealed for another: a fork's."""
    return seal({**record, "journal_id": journal_id})


def new_journal_id() -> str:
    """16 hex digits (``manifest.JOURNAL_ID_RE``), fresh for each header written."""
    return secrets.token_hex(8)


# -- writing ----------------------------------------------------------------------------------


def seal(record: dict[str, Any]) -> bytes:
    """``record`` as one journal line, checksum appended, newline-terminated. Raises
    ValueError for a value JSON cannot hold (NaN) or a record that already has a checksum."""
    if CHECKSUM_KEY in record or not record:
        raise ValueError("a record to seal must be non-empty and have no checksum yet")
    try:
        body = _dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: \u-escaped, it reads back the same
        body = _dumps(record, ensure_ascii=True).encode("ascii")
    digest = hashlib.sha256(body).hexdigest()
    return body[:-1] + b',"' + CHECKSUM_KEY.encode() + b'":"sha256:' + digest.encode() + b'"}\n'


def _dumps(value: Any, *, ensure_ascii: bool) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, separators=(",", ":"), allow_nan=False)


def turn_record(
    *,
    journal_id: str,
    turn: Turn,
    title: str,
    updated: str,
    messages: list[dict[str, Any]],
    token_ids: list[int],
    state: dict[str, Any] | None,
) -> bytes:
    """The sealed record of one saved turn (``state``: ``state_delta``, None if unchanged)."""
    record: dict[str, Any] = {
        "turn": turn.index,
        "journal_id": journal_id,
        "segment": {
            "file": turn.segment.file,
            "sha256": turn.segment.sha256,
            "nbytes": turn.segment.nbytes,
        },
        "n_tokens_total_after": turn.n_tokens_total_after,
        "updated": updated,
        "title": title,
        "messages": messages,
        "token_ids": token_ids,
        "extra": turn.extra,
    }
    if state is not None:
        record["engine_state"] = state
    return seal(record)


# -- engine_state deltas ----------------------------------------------------------------------


def state_delta(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any] | None:
    """What turns ``old`` into ``new`` (top-level keys): ``set`` values, ``drop`` keys, and
    ``extend`` strings that only grew by their suffix. None when nothing changed."""
    delta: dict[str, Any] = {}
    drop = [k for k in old if k not in new]
    extend = {}
    changed = {}
    for key, value in new.items():
        before = old.get(key, _MISSING)
        if before is _MISSING or before != value:
            if isinstance(before, str) and isinstance(value, str) and value.startswith(before):
                extend[key] = value[len(before) :]
            else:
                changed[key] = value
    for part, value in (("set", changed), ("drop", drop), ("extend", extend)):
        if value:
            delta[part] = value
    return delta or None


_MISSING = object()


def apply_state_delta(state: dict[str, Any], delta: Any) -> dict[str, Any]:
    """Apply a delta (as read from a record) to ``state`` in place, and return it. Raises
    ValueError, with what is wrong in words, for a delta that does not fit ``state``."""
    if not isinstance(delta, dict) or not delta or set(delta) - {"set", "drop", "extend"}:
        raise ValueError("is not an object of set/drop/extend")
    drop = delta.get("drop", [])
    extend = delta.get("extend", {})
    changed = delta.get("set", {})
    if not isinstance(drop, list) or not isinstance(extend, dict) or not isinstance(changed, dict):
        raise ValueError("has a part of the wrong type")
    for key in drop:
        if not isinstance(key, str) or key not in state:
            raise ValueError(f"drops {one_line(repr(key))[:40]}, which it does not hold")
        del state[key]
    for key, suffix in extend.items():
        if not isinstance(suffix, str) or not isinstance(state.get(key), str):
            raise ValueError(f"extends {one_line(repr(key))[:40]}, which is not a string")
        state[key] += suffix
    state.update(changed)
    return state


# -- reading ----------------------------------------------------------------------------------


@dataclass
class JournalRead:
    """What reading a journal found: ``size``, the bytes of its committed records (where
    the next one goes); ``torn``, the bytes after them, left by an interrupted save."""

    size: int
    torn: int


class _Reader:
    """Applies records one by one to the header's manifest, checking each fits."""

    def __init__(self, manifest: Manifest, journal_id: str, source: Path, conv_id: str) -> None:
        self.m = manifest
        self.journal_id = journal_id
        self.source = source
        self.conv_id = conv_id
        self.number = 0

    def damaged(self, what: str) -> ManifestError:
        return ManifestError(
            f"journal {self.source} of conversation {self.conv_id} is damaged "
            f"({one_line(what)}); restore it from a backup or run `kvchat delete {self.conv_id}`"
        )

    def edited(self, what: str) -> ManifestEditedError:
        return ManifestEditedError(
            f"journal {self.source} of conversation {self.conv_id} was changed outside kvchat "
            f"({what}); undo the edit or restore the file from a backup, "
            f"or run `kvchat delete {self.conv_id}`"
        )

    def unseal(self, line: bytes) -> dict[str, Any]:
        match = _SEAL.search(line)
        if match is None:
            raise self.edited(f"record {self.number} has no checksum")
        body = line[: match.start()] + b"}"
        if hashlib.sha256(body).hexdigest() != match.group(1).decode():
            raise self.edited(f"record {self.number}'s checksum no longer matches its content")
        try:
            record = json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise self.damaged(f"record {self.number} is not valid JSON: {e}") from None
        if not isinstance(record, dict):
            raise self.damaged(f"record {self.number} is not an object")
        return record

    def apply(self, record: dict[str, Any]) -> None:
        bad = self.bad_field
        m = self.m
        index = len(m.turns) + 1
        turn_no = checked_field(record, "turn", int, "", bad)
        if record.get("journal_id") != self.journal_id:
            raise self.damaged(f"record {self.number} belongs to another conversation's journal")
        if turn_no != index:
            raise bad(f"turn is {turn_no}, expected {index}")
        seg = checked_field(record, "segment", dict, "", bad)
        info = SegmentInfo(
            file=checked_field(seg, "file", str, "segment.", bad),
            sha256=checked_field(seg, "sha256", str, "segment.", bad),
            nbytes=checked_field(seg, "nbytes", int, "segment.", bad),
        )
        if info.file != segment_file_name(index):
            raise bad(f"segment.file is {info.file!r}")
        if not SHA256_RE.match(info.sha256) or info.nbytes < 0:
            raise bad("segment.sha256 or segment.nbytes is not valid")
        messages = _messages(checked_field(record, "messages", list, "", bad), bad)
        ids = checked_field(record, "token_ids", list, "", bad)
        if not all(type(t) is int for t in ids):
            raise bad("token_ids holds a non-integer")
        total = checked_field(record, "n_tokens_total_after", int, "", bad)
        if total != len(m.token_ids) + len(ids):
            adds_up = len(m.token_ids) + len(ids)
            raise bad(f"n_tokens_total_after is {total}, but the token ids add up to {adds_up}")
        extra = checked_field(record, "extra", dict, "", bad)
        title = checked_field(record, "title", str, "", bad)
        updated = checked_field(record, "updated", str, "", bad)
        try:
            datetime.fromisoformat(updated)
        except ValueError:
            raise bad("updated is not an ISO-8601 time") from None
        if "engine_state" in record:
            try:
                apply_state_delta(m.engine_state, record["engine_state"])
            except ValueError as e:
                raise bad(f"engine_state {e}") from None
        m.messages.extend(messages)
        m.token_ids.extend(ids)
        m.turns.append(Turn(index, total, info, extra))
        m.title, m.updated = title, updated

    def bad_field(self, what: str) -> ManifestError:
        return self.damaged(f"record {self.number}: {what}")


def _messages(messages: list[Any], bad: Callable[[str], Exception]) -> list[dict[str, Any]]:
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise bad(f"messages[{i}] is not an object")
        checked_field(msg, "role", str, f"messages[{i}].", bad)
        checked_field(msg, "content", str, f"messages[{i}].", bad)
    return messages


def read_journal(
    raw: bytes,
    manifest: Manifest,
    *,
    journal_id: str,
    source: Path,
    conv_id: str,
    highest_segment: int = 0,
    upto: int | None = None,
    records: list[dict[str, Any]] | None = None,
) -> JournalRead:
    """Apply the records in ``raw`` to ``manifest`` (the header's, changed in place).

    ``highest_segment`` is the largest ``turn-NNNN`` index in ``segments/``, listed *before*
    ``raw`` was read: a save writes its segment before its record, so a segment past the
    records plus the one being saved means records were lost. Raises ManifestError (or
    ManifestEditedError) with one line naming the file.

    With ``upto``, stops once the manifest holds that many turns: the conversation as it
    stood after turn ``upto`` (what a fork starts from). ``records`` collects each applied
    record (without its checksum), so a fork can reseal them for its own journal.
    """
    reader = _Reader(manifest, journal_id, source, conv_id)
    lines = raw.split(b"\n")
    tail = lines.pop()  # after the last newline: an interrupted save's record, or b""
    size = 0
    for number, line in enumerate(lines, start=1):
        if upto is not None and len(manifest.turns) >= upto:
            return JournalRead(size=size, torn=0)
        if number == len(lines) and not tail and b"\0" in line:
            tail = line + b"\n"  # zeros where a save's data never landed: torn too
            break
        reader.number = number
        record = reader.unseal(line)
        reader.apply(record)
        if records is not None:
            records.append(record)
        size += len(line) + 1
    turns = len(manifest.turns)
    if upto is not None and turns < upto:
        raise ValueError(f"the journal holds {turns} turn(s), not {upto}")
    if highest_segment > turns + 1:
        raise reader.damaged(
            f"it ends at turn {turns} but segments/{segment_file_name(highest_segment)} "
            "exists: records are missing"
        )
    return JournalRead(size=size, torn=len(raw) - size)
