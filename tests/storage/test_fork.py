"""ConversationStore.fork on real files: a branch at any turn, sharing segments, never
touching its parent, surviving either side's deletion and a kill -9 half way."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvchat.errors import StorageError
from kvchat.storage import ConversationLockedError, ConversationStore, ForkOrigin
from tests.storage.test_faults import REPO
from tests.storage.test_journal import FIXTURE, FIXTURE_ID
from tests.storage.test_store import FP, assert_same, new, one_line, turn_tensors


def saved_conversation(store: ConversationStore, n_turns: int) -> tuple[str, list]:
    """A closed conversation of ``n_turns`` turns whose engine_state changes every turn."""
    conv = new(store)
    saved = []
    for i in range(1, n_turns + 1):
        tensors = turn_tensors(i, n=3 + i)
        conv.append_turn(
            messages=[
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"answer {i}"},
            ],
            token_ids=list(range(100 * i, 100 * i + 3 + i)),
            tensors=tensors,
            extra={"turn": i},
            engine_state={"rendered": "x" * i, "n_cached": 10 * i},
        )
        saved.append(tensors)
    conv.close()
    return conv.id, saved


def files_of(path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "lock"
    }


@pytest.fixture
def store(tmp_path):
    return ConversationStore(tmp_path / "data")


def test_a_fork_at_turn_k_is_the_conversation_as_it_stood_after_turn_k(store):
    parent, saved = saved_conversation(store, 4)
    before = files_of(store.conversations_dir / parent)
    fork = store.fork(parent, turn=2)
    assert fork != parent
    assert files_of(store.conversations_dir / parent) == before  # the parent is untouched
    with store.open(fork, fingerprint=FP, dtype="bfloat16") as conv:
        m = conv.manifest
        assert [x["content"] for x in m.messages] == [
            "question 1",
            "answer 1",
            "question 2",
            "answer 2",
        ]
        assert m.token_ids == list(range(100, 104)) + list(range(200, 205))
        assert [t.extra for t in m.turns] == [{"turn": 1}, {"turn": 2}]
        assert m.engine_state == {"rendered": "xx", "n_cached": 20}
        assert m.title == "question 1"
        assert m.forked_from == ForkOrigin(parent, 2)
        for i in (1, 2):
            assert_same(conv.read_turn_tensors(i), saved[i - 1])
        # The fork goes on by itself: a new turn 3 that is not the parent's.
        conv.append_turn(
            messages=[{"role": "user", "content": "another question 3"}],
            token_ids=[7, 8],
            tensors={"h": torch.ones(2, 3)},
        )
    with store.open(fork) as conv:
        assert len(conv.manifest.turns) == 3
        assert conv.manifest.messages[-1]["content"] == "another question 3"
    assert files_of(store.conversations_dir / parent) == before
    with store.open(parent) as conv:
        assert len(conv.manifest.turns) == 4
        assert_same(conv.read_turn_tensors(3), saved[2])


def test_a_fork_shares_its_segments_instead_of_copying_them(store):
    parent, _ = saved_conversation(store, 3)
    fork = store.fork(parent)  # all turns
    for i in (1, 2, 3):
        name = f"segments/turn-{i:04d}.safetensors"
        a = os.stat(store.conversations_dir / parent / name)
        b = os.stat(store.conversations_dir / fork / name)
        assert a.st_ino == b.st_ino and a.st_nlink == 2
    with store.open(fork) as conv:
        assert len(conv.manifest.turns) == 3


def test_where_links_are_refused_the_fork_copies(store, monkeypatch):
    parent, saved = saved_conversation(store, 2)

    def no_links(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    fork = store.fork(parent)
    name = "segments/turn-0001.safetensors"
    a = os.stat(store.conversations_dir / parent / name)
    b = os.stat(store.conversations_dir / fork / name)
    assert a.st_ino != b.st_ino and b.st_mode & 0o777 == 0o600
    with store.open(fork) as conv:
        assert_same(conv.read_turn_tensors(2), saved[1])


def test_either_side_survives_deleting_the_other(store):
    parent, saved = saved_conversation(store, 3)
    first = store.fork(parent, turn=3)
    second = store.fork(parent, turn=1)
    store.delete(parent)
    with store.open(first) as conv:
        for i in (1, 2, 3):
            assert_same(conv.read_turn_tensors(i), saved[i - 1])
    store.delete(first)
    with store.open(second) as conv:
        assert_same(conv.read_turn_tensors(1), saved[0])
    # The other way round: a fork deleted, its parent whole.
    parent, saved = saved_conversation(store, 2)
    store.delete(store.fork(parent))
    with store.open(parent) as conv:
        for i in (1, 2):
            assert_same(conv.read_turn_tensors(i), saved[i - 1])


def test_a_fork_of_a_fork_branches_at_any_of_its_turns(store):
    parent, saved = saved_conversation(store, 3)
    fork = store.fork(parent, turn=3)
    grandchild = store.fork(fork, turn=1)
    with store.open(grandchild) as conv:
        assert conv.manifest.forked_from == ForkOrigin(fork, 1)
        assert conv.manifest.engine_state == {"rendered": "x", "n_cached": 10}
        assert_same(conv.read_turn_tensors(1), saved[0])


def test_turn_zero_is_an_empty_conversation_of_the_same_model(store):
    parent, _ = saved_conversation(store, 2)
    fork = store.fork(parent, turn=0)
    with store.open(fork, fingerprint=FP, dtype="bfloat16") as conv:
        assert conv.manifest.turns == [] and conv.manifest.messages == []
        assert conv.manifest.model.name == "smollm2-135m"


def test_list_shows_where_a_fork_came_from_and_lists_it_first(store):
    parent, _ = saved_conversation(store, 2)
    time.sleep(0.01)
    fork = store.fork(parent, turn=1)
    rows = store.list()
    assert [r.id for r in rows] == [fork, parent]
    assert rows[0].forked_from == ForkOrigin(parent, 1) and rows[0].turns == 1
    assert rows[1].forked_from is None


@pytest.mark.parametrize("turn", [-1, 3])
def test_a_turn_the_conversation_does_not_have_is_refused(store, turn):
    parent, _ = saved_conversation(store, 2)
    with pytest.raises(StorageError) as err:
        store.fork(parent, turn=turn)
    assert "between 0 and 2" in one_line(err)
    assert [r.id for r in store.list()] == [parent]


def test_an_open_parent_is_refused_until_it_is_closed(store):
    conv = new(store)
    conv.append_turn(messages=[], token_ids=[1], tensors={"h": torch.zeros(2)})
    with pytest.raises(ConversationLockedError):
        store.fork(conv.id)
    conv.close()
    assert store.fork(conv.id)


def test_an_old_format_conversation_forks_whole_but_not_inside_its_old_turns(tmp_path):
    store = ConversationStore(tmp_path)
    store.conversations_dir.mkdir(parents=True)
    shutil.copytree(FIXTURE, store.conversations_dir / FIXTURE_ID)
    with pytest.raises(StorageError) as err:
        store.fork(FIXTURE_ID, turn=1)
    assert "older kvchat" in one_line(err) and "turn 2 or later" in one_line(err)
    fork = store.fork(FIXTURE_ID)
    with store.open(fork) as conv:
        assert len(conv.manifest.turns) == 2
        assert conv.manifest.messages[0]["content"] == "question 1 — ünïcode"
        conv.read_turn_tensors(1)
        conv.append_turn(messages=[], token_ids=[5], tensors={"h": torch.zeros(1)})
    with store.open(fork) as conv:
        assert len(conv.manifest.turns) == 3


KILLED_FORK = """
    import os, sys, time
    from kvchat.storage import ConversationStore, branch
    real = branch.share_file
    calls = []
    def share_then_stall(source, target):
        done = real(source, target)
        calls.append(target)
        if len(calls) == 2:
            print("linked", flush=True)
            time.sleep(60)  # the parent kills us here
        return done
    branch.share_file = share_then_stall
    import kvchat.storage.store as store_module
    store_module.share_file = share_then_stall
    ConversationStore(sys.argv[1]).fork(sys.argv[2])
"""


def test_kill_9_half_way_through_a_fork_loses_nothing(store):
    parent, saved = saved_conversation(store, 3)
    before = files_of(store.conversations_dir / parent)
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_FORK), str(store.root), parent],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "linked"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert [r.id for r in store.list()] == [parent]  # no half-made fork is listed
    assert files_of(store.conversations_dir / parent) == before
    with store.open(parent) as conv:
        for i in (1, 2, 3):
            assert_same(conv.read_turn_tensors(i), saved[i - 1])
    leftovers = [n for n in os.listdir(store.conversations_dir) if n.startswith(".creating-")]
    assert len(leftovers) == 1
    old = time.time() - 120
    os.utime(store.conversations_dir / leftovers[0], (old, old))
    assert store.sweep_leftovers() > 0  # the dead fork's folder goes; the parent's links stay
    assert not [n for n in os.listdir(store.conversations_dir) if n.startswith(".")]
    assert all(
        os.stat(store.conversations_dir / parent / f"segments/turn-{i:04d}.safetensors").st_nlink
        == 1
        for i in (1, 2, 3)
    )
    assert store.fork(parent)
