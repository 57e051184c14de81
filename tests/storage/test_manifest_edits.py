"""Edits made to a manifest outside kvchat are detected, with one line naming the file."""

from __future__ import annotations

import json

import pytest

from kvchat.storage import ConversationStore, ManifestEditedError, ManifestError
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


def rewrite(conv, mutate) -> None:
    path = conv.path / "manifest.json"
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False))


def refused_everywhere(store, conv, other, error=ManifestError) -> str:
    with pytest.raises(error) as err:
        store.open(conv.id)
    message = str(err.value)
    assert str(conv.path / "manifest.json") in message and "\n" not in message
    assert f"kvchat delete {conv.id}" in message
    with pytest.raises(error):
        store.export(conv.id, "md")
    rows = {r.id: r for r in store.list()}
    assert rows[conv.id].error == message
    assert rows[other.id].error is None  # other conversations are unaffected
    store.open(other.id).close()
    return message


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
def test_an_edit_is_detected(store, mutate):
    conv, other = two_conversations(store)
    rewrite(conv, mutate)
    message = refused_everywhere(store, conv, other, ManifestEditedError)
    assert "changed outside kvchat" in message


def test_extra_token_ids_are_caught_even_without_the_checksum(store):
    conv, other = two_conversations(store)

    def mutate(d):
        del d["checksum"]
        d["token_ids"].append(1)

    rewrite(conv, mutate)
    message = refused_everywhere(store, conv, other)
    assert "token_ids holds 10 ids but the saved turns end at 9" in message


def test_reformatting_is_not_an_edit(store):
    conv, _ = two_conversations(store)
    path = conv.path / "manifest.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps(dict(reversed(list(data.items()))), indent=7))  # same content
    with store.open(conv.id) as again:
        assert len(again.manifest.turns) == 2


def test_a_manifest_without_checksum_opens_and_gets_one_at_the_next_save(store):
    conv, _ = two_conversations(store)
    rewrite(conv, lambda d: d.pop("checksum"))
    with store.open(conv.id) as again:
        save_turns(again, 1)
    assert json.loads((conv.path / "manifest.json").read_text())["checksum"].startswith("sha256:")
    rewrite(conv, lambda d: d["messages"].pop())
    with pytest.raises(ManifestEditedError):
        store.open(conv.id)
