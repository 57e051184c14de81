"""The per-turn journal: a save writes what the turn adds, and a crash anywhere in it leaves
exactly the previous turn or the new one.

``manifest.json`` is the header (written at create, rewritten only to migrate an old
conversation); ``journal.jsonl`` gets one self-checksummed record per turn.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchat.commands.export import export_text
from kvchat.errors import StorageError
from kvchat.storage import (
    Conversation,
    ConversationStore,
    ManifestEditedError,
    ManifestError,
    UnsafeFileError,
    atomic,
)
from kvchat.storage import journal as journal_mod
from kvchat.storage.folder import read_manifest
from kvchat.storage.journal import JOURNAL_NAME, apply_state_delta, seal, state_delta
from tests.storage.refusals import refused_everywhere as refused_with
from tests.storage.test_store import new

FIXTURE = Path(__file__).parent / "data" / "v1-conversation"
FIXTURE_ID = "20261201-131848-c762"


def content(i: int) -> dict:
    """Turn ``i``'s arguments to append_turn: every turn the same size."""
    g = torch.Generator().manual_seed(i)
    return dict(
        messages=[
            {"role": "user", "content": f"question {i:04d} ünï"},
            {"role": "assistant", "content": f"answer {i:04d}"},
        ],
        token_ids=[1000 + i] * 5,
        tensors={"h": torch.randn(4, 8, generator=g)},
        extra={"turn": i, "memory": {"weights": 1234, "kv": 56.5}},
        engine_state={"n_cached": 1000 + 5 * i, "cache": {"hot_window": 8}},
    )


def save(conv, i: int) -> None:
    conv.append_turn(**content(i))


def saved_conversation(store, n: int):
    conv = new(store)
    for i in range(1, n + 1):
        save(conv, i)
    conv.close()
    return conv


def check_turns(store, cid: str, n: int) -> None:
    """Open from disk: exactly turns 1..n of ``content``, bit-exact, no debris."""
    with store.open(cid) as conv:
        m = conv.manifest
        want = [content(i) for i in range(1, n + 1)]
        assert len(m.turns) == n
        assert m.messages == [x for w in want for x in w["messages"]]
        assert m.token_ids == [t for w in want for t in w["token_ids"]]
        assert [t.extra for t in m.turns] == [w["extra"] for w in want]
        assert m.engine_state == (want[-1]["engine_state"] if want else {})
        assert m.title == ("question 0001 ünï" if want else "")
        for i in range(1, n + 1):
            assert torch.equal(conv.read_turn_tensors(i)["h"], content(i)["tensors"]["h"])
        segs = sorted(os.listdir(conv.path / "segments"))
        assert segs == [f"turn-{i:04d}.safetensors" for i in range(1, n + 1)]
        assert sorted(os.listdir(conv.path)) == [JOURNAL_NAME, "lock", "manifest.json", "segments"]


def journal_lines(conv) -> list[bytes]:
    return (conv.path / JOURNAL_NAME).read_bytes().splitlines(keepends=True)


@pytest.fixture
def store(tmp_path):
    return ConversationStore(tmp_path / "data")


# -- a save costs what the turn costs ---------------------------------------------------------


class CountingOs:
    """``os`` inside kvchat.storage.atomic, counting bytes written per file name."""

    def __init__(self):
        self.fds: dict[int, str] = {}
        self.written: dict[str, int] = {}

    def open(self, path, flags, mode=0o777):
        fd = os.open(path, flags, mode)
        self.fds[fd] = os.path.basename(os.fspath(path))
        return fd

    def write(self, fd, data):
        n = os.write(fd, data)
        name = self.fds.get(fd, "?")
        self.written[name] = self.written.get(name, 0) + n
        return n

    def __getattr__(self, name):
        return getattr(os, name)


def bytes_saved_beside_the_segment(conv, i: int, monkeypatch) -> int:
    counter = CountingOs()
    monkeypatch.setattr(atomic, "os", counter)
    save(conv, i)
    monkeypatch.undo()
    return sum(n for name, n in counter.written.items() if "turn-" not in name)


def test_saving_a_turn_writes_only_that_turn(store, monkeypatch):
    conv = new(store)
    for i in range(1, 3):
        save(conv, i)
    header = (conv.path / "manifest.json").read_bytes()
    inode = os.stat(conv.path / "manifest.json").st_ino
    early = bytes_saved_beside_the_segment(conv, 3, monkeypatch)
    for i in range(4, 40):
        save(conv, i)
    late = bytes_saved_beside_the_segment(conv, 40, monkeypatch)
    # Turn 40 differs from turn 3 only in a few digits; the 37 turns between cost nothing.
    assert early < 1000 and abs(late - early) <= 8, (early, late)
    assert (conv.path / "manifest.json").read_bytes() == header  # the header is never rewritten
    assert os.stat(conv.path / "manifest.json").st_ino == inode
    assert len(journal_lines(conv)) == 40
    assert late == len(journal_lines(conv)[-1])  # the record is all that was written
    conv.close()
    check_turns(store, conv.id, 40)


def test_a_growing_engine_state_string_is_saved_as_what_it_gained(store):
    """The engine hands its rendered prompt (the whole conversation as text) in every
    turn's engine_state: a record holds only what was added to it."""
    with new(store) as conv:
        text = ""
        for i in range(1, 30):
            text += f"<turn {i}> " + "words " * 50
            conv.append_turn(
                messages=[], token_ids=[i], tensors={}, engine_state={"rendered": text, "n": i}
            )
        sizes = [len(line) for line in journal_lines(conv)]
        assert max(sizes[1:]) - min(sizes[1:]) <= 8, sizes
        assert max(sizes) < 800
    with store.open(conv.id) as again:
        assert again.manifest.engine_state == {"rendered": text, "n": 29}


def test_engine_state_changes_of_every_kind_survive_a_reopen(store):
    states = [
        {"a": 1, "s": "abc", "l": [1, 2]},
        {"a": 1, "s": "abcdef", "l": [1, 2], "new": {"x": None}},  # extended, added
        {"a": 2, "s": "xyz", "new": {"x": None}},  # replaced, removed
        {"a": 2, "s": "xyz", "new": {"x": None}},  # unchanged
        {},  # everything removed
        {"s": ""},
        {"s": "\u2028 line separator and ünïcode \ud800 lone surrogate"},
    ]
    with new(store) as conv:
        for i, state in enumerate(states, start=1):
            conv.append_turn(messages=[], token_ids=[i], tensors={}, engine_state=state)
            conv.append_turn(messages=[], token_ids=[], tensors={})  # kept unless replaced
    seen = []
    for n in range(1, 2 * len(states) + 1):
        cut = store.conversations_dir / f"cut{n}"
        shutil.copytree(conv.path, cut)
        lines = (cut / JOURNAL_NAME).read_bytes().splitlines(keepends=True)
        (cut / JOURNAL_NAME).write_bytes(b"".join(lines[:n]))
        for seg in sorted((cut / "segments").iterdir())[n:]:
            seg.unlink()
        seen.append(read_manifest(cut).engine_state)
    assert seen == [s for s in states for _ in (0, 1)]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
states = st.dictionaries(st.sampled_from(["a", "b", "c", "rendered"]), json_values | st.text())


@settings(max_examples=300, deadline=None)
@given(old=states, new=states)
def test_a_state_delta_applied_gives_the_new_state(old, new):
    delta = state_delta(old, new)
    if delta is None:
        assert old == new
        return
    assert json.loads(json.dumps(delta)) == delta
    assert apply_state_delta(json.loads(json.dumps(old)), delta) == new


def test_the_manifest_is_extended_in_place_once_a_save_commits(store, monkeypatch):
    with new(store) as conv:
        manifest = conv.manifest
        for i in (1, 2):
            save(conv, i)
        assert conv.manifest is manifest and len(manifest.turns) == 2
        monkeypatch.setattr(atomic, "os", FailingFsync())
        with pytest.raises(StorageError):
            save(conv, 3)
        monkeypatch.undo()
        assert conv.manifest is manifest and len(manifest.turns) == 2  # untouched by a failure


class FailingFsync:
    def fsync(self, fd):
        raise OSError(5, "Input/output error")

    def __getattr__(self, name):
        return getattr(os, name)


def test_an_adoption_cut_short_is_finished_by_the_next_call(store, monkeypatch):
    """Taking a committed save into memory is idempotent, and one left half done (two
    interrupts in a row) is completed before anything else is saved."""
    adopted = []
    real = Conversation._adopt
    monkeypatch.setattr(Conversation, "_adopt", lambda c, s: adopted.append(s) or real(c, s))
    conv = new(store)
    for i in (1, 2):
        save(conv, i)
    want = copy.deepcopy(conv.manifest)
    real(conv, adopted[-1])  # again: no change
    assert conv.manifest == want
    conv._adopting = adopted[-1]  # as if interrupted after these two steps:
    del conv.manifest.messages[-1]
    conv.manifest.token_ids.append(99)
    save(conv, 3)
    conv.close()
    check_turns(store, conv.id, 3)


# -- torn and damaged records -----------------------------------------------------------------


def test_a_torn_last_record_is_ignored_at_every_byte_and_dropped_at_open(store):
    conv = saved_conversation(store, 3)
    other = saved_conversation(store, 1)
    path = conv.path / JOURNAL_NAME
    seg3 = conv.path / "segments" / "turn-0003.safetensors"
    whole, seg3_bytes = path.read_bytes(), seg3.read_bytes()
    start = len(b"".join(journal_lines(conv)[:2]))
    last = whole[start:]
    tails = [last[:cut] for cut in range(1, len(last))]
    tails.append(b"\0" * len(last))  # the size reached the disk, the data did not
    tails.append(last[:40] + b"\0" * (len(last) - 41) + b"\n")  # one page of it did not
    tails.append(b"\0" * 5000)
    for tail in tails:
        path.write_bytes(whole[:start] + tail)
        seg3.write_bytes(seg3_bytes)  # the interrupted save had written its segment
        rows = {r.id: r for r in store.list()}
        assert (rows[conv.id].turns, rows[conv.id].error) == (2, None), tail
        assert rows[other.id].error is None
        assert len(json.loads(export_text(store, conv.id, "json"))["messages"]) == 4
        assert path.read_bytes() == whole[:start] + tail  # readers without the lock change nothing
        check_turns(store, conv.id, 2)  # open: the torn record and its segment are gone
        assert path.read_bytes() == whole[:start]
    with store.open(conv.id) as again:
        save(again, 3)
    assert without_time(path.read_bytes()[start:]) == without_time(last)
    check_turns(store, conv.id, 3)


def without_time(record: bytes) -> dict:
    """A record but for what differs when the same turn is saved again: the time, the
    segment's hash (safetensors writes its metadata keys in hash-map order), the checksum."""
    data = json.loads(record)
    del data["updated"], data["checksum"], data["segment"]["sha256"]
    return data


def test_a_torn_tail_left_by_a_failed_save_is_dropped_before_the_next_record(store):
    with new(store) as conv:
        save(conv, 1)
        with open(conv.path / JOURNAL_NAME, "ab") as f:
            f.write(b'{"turn":2,"journal_id":"')  # as if the truncation after a failure failed
        save(conv, 2)
    check_turns(store, conv.id, 2)


def damage(path: Path, line: int, edit) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    lines[line] = edit(lines[line])
    path.write_bytes(b"".join(lines))


def refused_everywhere(store, conv, other, error=ManifestError) -> str:
    return refused_with(store, conv, other, error, file=JOURNAL_NAME)


@pytest.mark.parametrize("line", [0, 1, 2], ids=["first", "middle", "last"])
def test_an_edited_record_is_reported_wherever_it_is(store, line):
    conv, other = saved_conversation(store, 3), saved_conversation(store, 1)
    damage(conv.path / JOURNAL_NAME, line, lambda b: b.replace(b"answer", b"ANSWER"))
    before = (conv.path / JOURNAL_NAME).read_bytes()
    message = refused_everywhere(store, conv, other, ManifestEditedError)
    assert f"record {line + 1}" in message and "changed outside kvchat" in message
    assert (conv.path / JOURNAL_NAME).read_bytes() == before  # never "repaired" away
    assert len(os.listdir(conv.path / "segments")) == 3


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda b: b[:-3] + b"x" + b[-2:], "changed outside kvchat"),  # checksum itself
        (lambda b: b[: b.index(b',"checksum"')] + b"}\n", "no checksum"),
        (lambda b: b"\n", "no checksum"),  # an empty line in the middle
        (lambda b: b"\xff\xfe\n", "no checksum"),
    ],
    ids=["checksum-digit", "checksum-removed", "empty-line", "binary"],
)
def test_a_record_without_its_checksum_is_an_edit(store, edit, fragment):
    conv, other = saved_conversation(store, 3), saved_conversation(store, 1)
    damage(conv.path / JOURNAL_NAME, 1, edit)
    message = refused_everywhere(store, conv, other, ManifestEditedError)
    assert fragment in message and "record 2" in message


def reseal(mutate):
    """Edit a record and recompute its checksum, so the structural checks are reached."""

    def edit(line: bytes) -> bytes:
        record = json.loads(line)
        del record["checksum"]
        mutate(record)
        return seal(record)

    return edit


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda r: r["token_ids"].append(1), "n_tokens_total_after"),
        (lambda r: r.__setitem__("turn", 5), "turn is 5, expected 2"),
        (lambda r: r.__setitem__("journal_id", "0" * 16), "another conversation's journal"),
        (lambda r: r["segment"].__setitem__("file", "../x"), "segment.file"),
        (lambda r: r["messages"].append({"role": "user"}), "messages[2].content missing"),
        (lambda r: r.__setitem__("engine_state", {"extend": {"zz": "x"}}), "engine_state"),
        (lambda r: r.__setitem__("updated", "yesterday"), "updated is not an ISO-8601"),
        (lambda r: r.pop("extra"), "extra missing"),
    ],
)
def test_a_resealed_record_that_does_not_fit_is_damage(store, mutate, fragment):
    conv, other = saved_conversation(store, 3), saved_conversation(store, 1)
    damage(conv.path / JOURNAL_NAME, 1, reseal(mutate))
    message = refused_everywhere(store, conv, other)
    assert "record 2" in message and fragment in message and "damaged" in message


def test_a_resealed_edit_that_fits_is_read_as_written(store):
    """The checksum catches edits and damage, not forgery: resealed, a record is believed."""
    conv = saved_conversation(store, 2)
    damage(conv.path / JOURNAL_NAME, 1, reseal(lambda r: r["messages"][1].update(content="hi")))
    with store.open(conv.id) as again:
        assert again.manifest.messages[-1]["content"] == "hi"


def test_a_journal_cut_short_of_saved_turns_is_refused_not_swept(store):
    """Lost whole records (a truncated copy, a partial restore) with their turns' segments
    still there are damage, not an interrupted save: nothing is deleted."""
    conv, other = saved_conversation(store, 3), saved_conversation(store, 1)
    path = conv.path / JOURNAL_NAME
    path.write_bytes(b"".join(journal_lines(conv)[:1]) + b'{"tu')
    message = refused_everywhere(store, conv, other)
    assert "turn-0003.safetensors" in message and "records are missing" in message
    assert len(os.listdir(conv.path / "segments")) == 3


def test_a_missing_journal_is_refused(store):
    conv, other = saved_conversation(store, 2), saved_conversation(store, 1)
    (conv.path / JOURNAL_NAME).unlink()
    message = refused_everywhere(store, conv, other)
    assert "is missing" in message


def test_a_journal_from_another_conversation_is_refused(store):
    conv, other = saved_conversation(store, 2), saved_conversation(store, 2)
    shutil.copy(other.path / JOURNAL_NAME, conv.path / JOURNAL_NAME)
    message = refused_everywhere(store, conv, other)
    assert "another conversation's journal" in message


def test_a_hard_linked_journal_is_never_written_through(store, tmp_path):
    conv = saved_conversation(store, 1)
    outside = tmp_path / "outside.jsonl"
    os.link(conv.path / JOURNAL_NAME, outside)
    before = outside.read_bytes()
    with pytest.raises(UnsafeFileError) as err:
        store.open(conv.id)
    assert "hard links" in str(err.value) and "\n" not in str(err.value)
    assert outside.read_bytes() == before
    assert store.list()[0].turns == 1  # still readable: reading one cannot hurt the other file


# -- crash at every step of a save ------------------------------------------------------------


class CrashImages:
    """``os`` inside kvchat.storage.atomic (segments, journal and manifest writes all go
    through it). Before each call that changes a file, and half-way through each write,
    copies the conversation folder as a crash at that instant would leave it (everything
    issued so far on disk; torn records that lost data are tested above)."""

    MUTATING = ("fsync", "replace", "rename", "ftruncate", "unlink", "close", "lseek")

    def __init__(self, folder: Path, out: Path):
        self.folder, self.out = folder, out
        self.images: list[Path] = []

    def snapshot(self, why: str) -> None:
        image = self.out / f"{len(self.images):03d}" / "conversations" / self.folder.name
        shutil.copytree(self.folder, image, symlinks=True)
        (image.parent.parent / "why").write_text(why)
        self.images.append(image.parent.parent)

    def open(self, path, flags, mode=0o777):
        if flags & os.O_CREAT:
            self.snapshot(f"open {path}")
        return os.open(path, flags, mode)

    def write(self, fd, data):
        self.snapshot("write")
        if len(data) > 1:  # a short write: _write_all sends the rest in another call
            n = os.write(fd, bytes(data[: len(data) // 2]))
            self.snapshot("half written")
            return n
        return os.write(fd, data)

    def __getattr__(self, name):
        real = getattr(os, name)
        if name not in self.MUTATING:
            return real

        def call(*args, **kwargs):
            self.snapshot(name)
            return real(*args, **kwargs)

        return call


def crash_everywhere(store, conv, index: int, tmp_path, monkeypatch) -> list[int]:
    """Save turn ``index`` under CrashImages; open every image and return its turn count,
    after checking it is exactly one of the two states and that it saves again."""
    crash = CrashImages(conv.path, tmp_path / "images")
    monkeypatch.setattr(atomic, "os", crash)
    save(conv, index)
    monkeypatch.undo()
    conv.close()
    assert len(crash.images) > 5
    counts = []
    for root in crash.images:
        image_store = ConversationStore(root)
        (row,) = image_store.list()
        assert row.error is None, (root / "why").read_text()
        assert row.turns in (index - 1, index), (root / "why").read_text()
        check_turns(image_store, conv.id, row.turns)
        with image_store.open(conv.id) as again:
            save(again, row.turns + 1)
        check_turns(image_store, conv.id, row.turns + 1)
        counts.append(row.turns)
    check_turns(store, conv.id, index)
    return counts


def test_a_crash_anywhere_in_a_save_leaves_the_previous_or_the_new_turn(
    store, tmp_path, monkeypatch
):
    conv = new(store)
    for i in (1, 2):
        save(conv, i)
    counts = crash_everywhere(store, conv, 3, tmp_path, monkeypatch)
    assert counts[0] == 2 and counts[-1] == 3  # both sides of the commit were imaged
    assert counts == sorted(counts)  # one commit point: once saved, saved in every later image


def test_a_crash_anywhere_in_the_first_save_after_create(store, tmp_path, monkeypatch):
    conv = new(store)
    counts = crash_everywhere(store, conv, 1, tmp_path, monkeypatch)
    assert counts[0] == 0 and counts[-1] == 1 and counts == sorted(counts)


# -- conversations saved by the old format (one manifest.json) --------------------------------


def fixture_turn(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"h": torch.randn(3 + i, 4, generator=g), "positions": torch.arange(3 + i)}


@pytest.fixture
def old_store(tmp_path):
    """A copy of a two-turn conversation written by kvchat before the journal (format 1)."""
    store = ConversationStore(tmp_path / "data")
    store.conversations_dir.mkdir(parents=True)
    shutil.copytree(FIXTURE, store.conversations_dir / FIXTURE_ID)
    return store


def check_old_turns(m) -> None:
    assert m.title == "question 1 — ünïcode"
    assert m.settings == {"system": "Be brief.", "weights": "none"}
    assert [x["content"] for x in m.messages[:4]] == [
        "question 1 — ünïcode", "answer 1", "question 2 — ünïcode", "answer 2",
    ]  # fmt: skip
    assert m.token_ids[:9] == [100, 101, 102, 103, *range(200, 205)]
    assert [t.n_tokens_total_after for t in m.turns[:2]] == [4, 9]
    assert [t.extra["turn"] for t in m.turns[:2]] == [1, 2]
    assert m.turns[1].extra["memory"] == {"weights": 1234, "kv": 56.5}


def test_an_old_conversation_lists_exports_and_opens(old_store):
    (row,) = old_store.list()
    assert (row.id, row.turns, row.tokens, row.error) == (FIXTURE_ID, 2, 9, None)
    assert row.title == "question 1 — ünïcode"
    assert "answer 2" in export_text(old_store, FIXTURE_ID, "md")
    assert len(json.loads(export_text(old_store, FIXTURE_ID, "json"))["messages"]) == 4
    with old_store.open(FIXTURE_ID) as conv:
        check_old_turns(conv.manifest)
        assert conv.manifest.engine_state == {
            "rendered": "x" * 20, "n_cached": 6, "cache": {"hot_window": 8},
        }  # fmt: skip
        for i in (1, 2):
            got = conv.read_turn_tensors(i)
            assert all(torch.equal(got[k], v) for k, v in fixture_turn(i).items())
    assert not (conv.path / JOURNAL_NAME).exists()  # reading never converts


def test_an_old_conversation_resumes_and_is_migrated_at_its_next_save(old_store):
    with old_store.open(FIXTURE_ID) as conv:
        before = copy.deepcopy(conv.manifest)
        save(conv, 3)
        assert conv.manifest.format_version == 2
    header = json.loads((conv.path / "manifest.json").read_text())
    assert header["format_version"] == 2 and len(header["turns"]) == 3  # one atomic rewrite
    assert (conv.path / JOURNAL_NAME).read_bytes() == b""
    with old_store.open(FIXTURE_ID) as conv:
        save(conv, 4)  # from now on, one record per turn
        m = conv.manifest
    assert len(journal_lines(conv)) == 1
    with old_store.open(FIXTURE_ID) as again:
        assert again.manifest == m
        check_old_turns(again.manifest)
        assert again.manifest.messages[:4] == before.messages
        assert again.manifest.turns[:2] == before.turns
        assert again.manifest.engine_state == content(4)["engine_state"]
        assert torch.equal(again.read_turn_tensors(1)["h"], fixture_turn(1)["h"])
        assert torch.equal(again.read_turn_tensors(4)["h"], content(4)["tensors"]["h"])
    (row,) = old_store.list()
    assert (row.turns, row.tokens, row.error) == (4, 19, None)


def test_a_crash_anywhere_in_the_migrating_save(old_store, tmp_path, monkeypatch):
    conv = old_store.open(FIXTURE_ID)
    crash = CrashImages(conv.path, tmp_path / "images")
    monkeypatch.setattr(atomic, "os", crash)
    save(conv, 3)
    monkeypatch.undo()
    conv.close()
    counts = []
    for root in crash.images:
        image_store = ConversationStore(root)
        (row,) = image_store.list()
        assert row.error is None and row.turns in (2, 3), (root / "why").read_text()
        with image_store.open(FIXTURE_ID) as again:
            check_old_turns(again.manifest)
            assert len(again.manifest.turns) == row.turns
            names = sorted(os.listdir(again.path))
            if row.turns == 2:  # still the old format; an interrupted migration left nothing
                assert names == ["lock", "manifest.json", "segments"]
                assert len(os.listdir(again.path / "segments")) == 2
            save(again, row.turns + 1)
        with image_store.open(FIXTURE_ID) as again:
            assert len(again.manifest.turns) == row.turns + 1
            again.read_turn_tensors(row.turns + 1)
        counts.append(row.turns)
    assert counts[0] == 2 and counts[-1] == 3 and counts == sorted(counts)


def test_the_journal_module_needs_no_store(tmp_path):
    """The record format is usable on its own (the fuzz tests and tools reseal with it)."""
    line = seal({"turn": 1, "x": "ü"})
    assert line.endswith(b'"}\n') and b"\n" not in line[:-1]
    assert json.loads(line)["checksum"].startswith("sha256:")
    assert journal_mod.JOURNAL_NAME == "journal.jsonl"
