"""Edits made to a conversation's files outside kvchat are detected, with one line naming the
file: the header ``manifest.json``, a record of ``journal.jsonl``, or the single
``manifest.json`` of a conversation saved before the journal."""

from __future__ import annotations

import json
import shutil

import pytest

from kvchat.storage import ConversationStore, ManifestEditedError
from kvchat.storage.journal import JOURNAL_NAME
from tests.storage.refusals import refused_everywhere
from tests.storage.test_journal import FIXTURE, FIXTURE_ID
from tests.storage.test_store import new, save_turns


@pytest.fixture
def store(tmp_path):
    return ConversationStore(tmp_path / "data")


def two_conversations(store):
    edited, other = new(store), new(store)
    save_turns(edited, 2)
    save_turns(other, 1)
    edited.close(), other.close()
    return edited, other


def old_and_new(store):
    """The two-turn conversation of the old format (one manifest.json), and another."""
    store.conversations_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(FIXTURE, store.conversations_dir / FIXTURE_ID)
    other = new(store)
    save_turns(other, 1)
    other.close()
    return store.conversations_dir / FIXTURE_ID, other


class Old:
    """Just what ``refused_everywhere`` needs of a conversation."""

    def __init__(self, path):
        self.path, self.id = path, path.name


def rewrite(conv, mutate) -> None:
    path = conv.path / "manifest.json"
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False))


def rewrite_record(conv, line: int, mutate) -> None:
    """Change one record's content, keeping the checksum it had."""
    path = conv.path / JOURNAL_NAME
    lines = path.read_text().splitlines(keepends=True)
    record = json.loads(lines[line])
    mutate(record)
    lines[line] = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
    path.write_text("".join(lines))


@pytest.mark.parametrize(
    "line, mutate",
    [
        (1, lambda d: d["token_ids"].extend([7, 8, 9])),
        (1, lambda d: d["messages"][1].__setitem__("content", "an answer I prefer")),
        (0, lambda d: d["messages"][0].__setitem__("content", "a question I prefer")),
        (1, lambda d: d.__setitem__("title", "renamed")),
        (1, lambda d: d.__setitem__("engine_state", {"set": {"n_cached": 999}})),
        (0, lambda d: d["extra"].__setitem__("turn", 5)),
        (1, lambda d: d["segment"].__setitem__("nbytes", 1)),
    ],
    ids=[
        "extra-token-ids", "message-text", "first-message", "title", "engine-state",
        "turn-extra", "segment-size",
    ],
)  # fmt: skip
def test_an_edit_of_a_record_is_detected(store, line, mutate):
    conv, other = two_conversations(store)
    rewrite_record(conv, line, mutate)
    message = refused_everywhere(store, conv, other, ManifestEditedError, JOURNAL_NAME)
    assert "changed outside kvchat" in message and f"record {line + 1}" in message


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.__setitem__("title", "renamed"),
        lambda d: d["settings"].__setitem__("system", "Be verbose."),
        lambda d: d["model"].__setitem__("fingerprint", "sha256:" + "cd" * 32),
        lambda d: d.__setitem__("created", "2020-01-01T00:00:00+00:00"),
        lambda d: d.__setitem__("journal_id", "0" * 16),
    ],
    ids=["title", "settings", "fingerprint", "created", "journal-id"],
)
def test_an_edit_of_the_header_is_detected(store, mutate):
    conv, other = two_conversations(store)
    rewrite(conv, mutate)
    message = refused_everywhere(store, conv, other, ManifestEditedError)
    assert "changed outside kvchat" in message


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["token_ids"].extend([7, 8, 9]),
        lambda d: d["messages"][1].__setitem__("content", "an answer I prefer"),
        lambda d: d.__setitem__("title", "renamed"),
        lambda d: d["engine_state"].__setitem__("n_cached", 999),
        lambda d: d["turns"][0]["extra"].__setitem__("turn", 5),
    ],
    ids=["extra-token-ids", "message-text", "title", "engine-state", "turn-extra"],
)
def test_an_edit_of_an_old_manifest_is_detected(store, mutate):
    path, other = old_and_new(store)
    conv = Old(path)
    rewrite(conv, mutate)
    message = refused_everywhere(store, conv, other, ManifestEditedError)
    assert "changed outside kvchat" in message


def test_extra_token_ids_are_caught_even_without_the_checksum(store):
    """Only the old format may lack checksums; its token counts must still add up."""
    path, other = old_and_new(store)
    conv = Old(path)

    def mutate(d):
        del d["checksum"]
        d["token_ids"].append(1)

    rewrite(conv, mutate)
    message = refused_everywhere(store, conv, other)
    assert "token_ids holds 10 ids but the saved turns end at 9" in message


def test_a_record_or_header_without_its_checksum_is_refused(store):
    conv, other = two_conversations(store)

    def mutate(d):
        del d["checksum"]
        d["token_ids"].append(1)

    rewrite_record(conv, 1, mutate)
    message = refused_everywhere(store, conv, other, ManifestEditedError, JOURNAL_NAME)
    assert "record 2 has no checksum" in message
    conv, other = two_conversations(store)
    rewrite(conv, lambda d: d.pop("checksum"))
    message = refused_everywhere(store, conv, other, ManifestEditedError)
    assert "no checksum" in message


@pytest.mark.parametrize("old", [False, True], ids=["header", "old-manifest"])
def test_reformatting_is_not_an_edit(store, old):
    conv = Old(old_and_new(store)[0]) if old else two_conversations(store)[0]
    path = conv.path / "manifest.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps(dict(reversed(list(data.items()))), indent=7))  # same content
    with store.open(conv.id) as again:
        assert len(again.manifest.turns) == 2


def test_a_manifest_without_checksum_opens_and_gets_one_at_the_next_save(store):
    path, _ = old_and_new(store)
    conv = Old(path)
    rewrite(conv, lambda d: d.pop("checksum"))
    with store.open(conv.id) as again:
        save_turns(again, 1)
    assert json.loads((conv.path / "manifest.json").read_text())["checksum"].startswith("sha256:")
    rewrite(conv, lambda d: d["messages"].pop())
    with pytest.raises(ManifestEditedError):
        store.open(conv.id)
