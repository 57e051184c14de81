"""Files an adversary can point the store at: links, hard links, FIFOs, a permissive umask."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from kvchat.commands.export import export_text
from kvchat.storage import (
    ConversationStore,
    ManifestError,
    SegmentCorruptedError,
    UnsafeFileError,
)
from kvchat.storage.journal import JOURNAL_NAME
from tests.storage.test_store import new, save_turns


@pytest.fixture
def store(tmp_path):
    return ConversationStore(tmp_path / "data")


@pytest.fixture
def important(tmp_path):
    victim = tmp_path / "important.txt"
    victim.write_text("precious\n")
    return victim


def saved(store, turns: int = 2):
    conv = new(store)
    save_turns(conv, turns)
    conv.close()
    return conv


def test_lock_link_is_refused_and_its_target_untouched(store, important):
    conv = saved(store)
    lock = conv.path / "lock"
    lock.unlink()
    lock.symlink_to(important)
    for attempt in (lambda: store.open(conv.id), lambda: store.check_not_open(conv.id)):
        with pytest.raises(UnsafeFileError) as err:
            attempt()
        assert "symbolic link" in str(err.value) and str(lock) in str(err.value)
    assert important.read_text() == "precious\n"
    assert store.delete(conv.id).link_only is False  # the way out: the folder goes
    assert important.read_text() == "precious\n"
    assert store.list() == []


def test_lock_hard_link_is_refused_and_its_target_untouched(store, important):
    conv = saved(store)
    lock = conv.path / "lock"
    lock.unlink()
    important.chmod(0o644)
    os.link(important, lock)
    with pytest.raises(UnsafeFileError) as err:
        store.open(conv.id)
    assert "hard links" in str(err.value)
    assert important.read_text() == "precious\n"
    assert stat.S_IMODE(important.stat().st_mode) == 0o644  # not even chmod-ed
    store.delete(conv.id)  # the way out: the folder goes, the other name of the file stays
    assert important.read_text() == "precious\n" and store.list() == []


@pytest.mark.parametrize("name", ["manifest.json", JOURNAL_NAME])
def test_manifest_link_is_refused_everywhere(store, tmp_path, name):
    conv, good = saved(store), saved(store, 1)
    manifest = conv.path / name
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(manifest.read_bytes())  # a perfectly valid file, but a link
    manifest.unlink()
    manifest.symlink_to(elsewhere)
    for attempt in (lambda: store.open(conv.id), lambda: export_text(store, conv.id, "md")):
        with pytest.raises(ManifestError) as err:
            attempt()
        assert "symbolic link" in str(err.value) and f"kvchat delete {conv.id}" in str(err.value)
    rows = {r.id: r for r in store.list()}
    assert "symbolic link" in rows[conv.id].error and rows[good.id].error is None
    before = elsewhere.read_bytes()
    store.delete(conv.id)
    assert elsewhere.read_bytes() == before
    assert [r.id for r in store.list()] == [good.id]


def test_segment_link_is_refused(store, tmp_path):
    conv = saved(store)
    seg = conv.path / "segments" / "turn-0002.safetensors"
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(seg.read_bytes())  # same bytes, same checksum: only the link is wrong
    seg.unlink()
    seg.symlink_to(copy)
    with store.open(conv.id) as again:
        again.read_turn_tensors(1)
        for read in (
            lambda: again.read_turn_tensors(2),
            lambda: again.tensor_layout(2),
            lambda: list(again.iter_tensors()),
            lambda: again.open_slice(2, "positions", 0, 1),
        ):
            with pytest.raises(SegmentCorruptedError) as err:
                read()
            assert "symbolic link" in str(err.value)
    (row,) = store.list()
    assert "symbolic link" in row.error


def test_linked_conversation_folder_is_listed_refused_and_deleted_as_a_link(store, tmp_path):
    conv = saved(store)
    outside = tmp_path / "outside"
    conv.path.rename(outside)  # a real conversation, reached through a link
    os.symlink(outside, conv.path)
    (row,) = store.list()  # not hidden: the user can see it and delete it
    assert row.id == conv.id and "symbolic link" in row.error
    for attempt in (
        lambda: store.open(conv.id),
        lambda: store.open(conv.id[:10]),
        lambda: store.check_not_open(conv.id),
        lambda: export_text(store, conv.id, "md"),
        lambda: export_text(store, conv.id, "json"),
    ):
        with pytest.raises(UnsafeFileError) as err:
            attempt()
        assert "symbolic link" in str(err.value) and f"kvchat delete {conv.id}" in str(err.value)
    before = sorted(p.name for p in outside.rglob("*"))
    outcome = store.delete(conv.id)
    assert outcome.link_only and outcome.id == conv.id
    assert not os.path.lexists(conv.path)
    assert sorted(p.name for p in outside.rglob("*")) == before  # the target is untouched
    assert store.list() == []
    assert os.listdir(store.conversations_dir) == []  # no hidden leftover either


def test_linked_segments_folder_is_refused(store, tmp_path):
    conv = saved(store)
    outside = tmp_path / "segs"
    (conv.path / "segments").rename(outside)
    os.symlink(outside, conv.path / "segments")
    (outside / "turn-0009.safetensors").write_bytes(b"would be swept as debris")
    with pytest.raises(UnsafeFileError) as err:
        store.open(conv.id)
    assert "segments folder" in str(err.value)
    assert (outside / "turn-0009.safetensors").exists()  # open never swept through the link
    store.delete(conv.id)
    assert (outside / "turn-0009.safetensors").exists()


@pytest.mark.parametrize("name", ["manifest.json", JOURNAL_NAME])
def test_fifo_manifest_does_not_hang(store, name):
    conv = saved(store, 1)
    manifest = conv.path / name
    manifest.unlink()
    os.mkfifo(manifest)
    started = time.monotonic()
    with pytest.raises(ManifestError) as err:
        store.open(conv.id)
    assert "not a regular file" in str(err.value)
    (row,) = store.list()
    assert row.error
    assert time.monotonic() - started < 5


def test_stale_delete_leftover_that_is_a_link_goes_without_following(store, important):
    saved(store, 1)
    trash = store.conversations_dir / ".deleting-x-1234"
    os.symlink(important.parent, trash)
    store.sweep_leftovers()
    assert not os.path.lexists(trash) and important.read_text() == "precious\n"


@pytest.fixture
def umask():
    previous = os.umask(0o022)

    def set_umask(value: int) -> None:
        os.umask(value)

    yield set_umask
    os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("value", [0o000, 0o022, 0o277])
def test_folders_0700_and_files_0600_whatever_the_umask(tmp_path, umask, value):
    umask(value)
    store = ConversationStore(tmp_path / "new" / "data")
    conv = new(store)
    save_turns(conv, 2)
    conv.close()
    for folder in (tmp_path / "new", store.root, store.conversations_dir, conv.path):
        assert mode(folder) == 0o700, folder
    assert mode(conv.path / "segments") == 0o700
    files = [conv.path / "manifest.json", conv.path / JOURNAL_NAME, conv.path / "lock"]
    files += list((conv.path / "segments").iterdir())
    assert len(files) == 5
    for file in files:
        assert mode(file) == 0o600, file
    with store.open(conv.id):  # reopening (the lock) keeps the modes
        pass
    assert mode(conv.path / "lock") == 0o600


def test_permissive_folders_of_an_older_kvchat_are_tightened(tmp_path, umask):
    umask(0)
    store = ConversationStore(tmp_path / "data")
    store.conversations_dir.mkdir(parents=True, mode=0o777)
    conv = new(store)
    conv.close()
    assert mode(store.conversations_dir) == 0o700
    (conv.path / "lock").chmod(0o666)
    store.open(conv.id).close()
    assert mode(conv.path / "lock") == 0o600


def test_store_files_hold_what_we_wrote(store):
    """The safety checks must not change what a normal save and open see."""
    conv = saved(store, 3)
    header = json.loads((conv.path / "manifest.json").read_text())
    assert header["format_version"] == 2 and header["turns"] == []
    records = [json.loads(line) for line in (conv.path / JOURNAL_NAME).read_text().splitlines()]
    assert [r["turn"] for r in records] == [1, 2, 3]
    with store.open(conv.id) as again:
        assert len(list(again.iter_tensors())) == 9
