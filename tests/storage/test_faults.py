"""Failures during a save: disk full, I/O errors, Ctrl-C, a killed process, a full filesystem.

In every case the conversation must still open exactly as it was after the previous turn
(or, past the commit point, with the new turn). A save appends one record to
``journal.jsonl``; the first save of a conversation of the old format rewrites its
``manifest.json`` once instead.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvchat.storage import ConversationStore, SaveFailedError, atomic
from kvchat.storage.journal import JOURNAL_NAME as JOURNAL
from tests.storage.test_journal import FIXTURE, FIXTURE_ID

REPO = Path(__file__).resolve().parents[2]
ENOSPC = OSError(errno.ENOSPC, "No space left on device")
EIO = OSError(errno.EIO, "Input/output error")


class FaultyOs:
    """Replaces ``os`` inside kvchat.storage.atomic only. Writes to (or fsyncs of) files whose
    name contains ``match`` raise ``exc`` once ``budget`` bytes of them have been written,
    after really writing those bytes: a partial file is left, as on a real full disk.
    ``times`` fsync faults, then fsync works again (None: a disk that keeps failing)."""

    def __init__(
        self,
        match: str,
        exc: BaseException,
        budget: int = 0,
        on: str = "write",
        times: int | None = None,
    ):
        self.match, self.exc, self.budget, self.on, self.times = match, exc, budget, on, times
        self.fds: dict[int, str] = {}
        self.tripped = False

    def _hit(self, fd: int) -> bool:
        return self.match in os.path.basename(self.fds.get(fd, ""))

    def open(self, path, flags, mode=0o777):
        fd = os.open(path, flags, mode)
        self.fds[fd] = os.fspath(path)
        return fd

    def close(self, fd):
        self.fds.pop(fd, None)
        os.close(fd)

    def write(self, fd, data):
        if self.on == "write" and self._hit(fd):
            if self.budget <= 0:
                self.tripped = True
                raise self.exc
            n = os.write(fd, bytes(data[: self.budget]))
            self.budget -= n
            return n
        return os.write(fd, data)

    def fsync(self, fd):
        if self.on == "fsync" and self._hit(fd) and self.times != 0:
            self.tripped = True
            if self.times is not None:
                self.times -= 1
            raise self.exc
        os.fsync(fd)

    def __getattr__(self, name):
        return getattr(os, name)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "h32": torch.randn(64, 32, generator=g),
        "h16": torch.randn(64, 32, generator=g).to(torch.bfloat16),
    }


def turn(conv, seed: int) -> None:
    conv.append_turn(
        messages=[{"role": "user", "content": f"q{seed}"}, {"role": "assistant", "content": "a"}],
        token_ids=[seed] * 3,
        tensors=tensors(seed),
        extra={"seed": seed},
    )


def assert_state(store: ConversationStore, conv_id: str, n_turns: int) -> None:
    """Reopen from disk: exactly n_turns, all bit-exact, no debris left in the folder."""
    with store.open(conv_id) as conv:
        m = conv.manifest
        assert len(m.turns) == n_turns
        assert len(m.token_ids) == 3 * n_turns and len(m.messages) == 2 * n_turns
        for i in range(1, n_turns + 1):
            got = conv.read_turn_tensors(i)
            for k, v in tensors(i).items():
                assert torch.equal(got[k], v)
        names = sorted(os.listdir(conv.path / "segments"))
        assert names == [f"turn-{i:04d}.safetensors" for i in range(1, n_turns + 1)]
        assert sorted(os.listdir(conv.path)) == [JOURNAL, "lock", "manifest.json", "segments"]


@pytest.fixture
def conv_with_two_turns(tmp_path):
    store = ConversationStore(tmp_path)
    conv = store.create(model_name="m", fingerprint="fp", dtype="float32", settings={})
    turn(conv, 1)
    turn(conv, 2)
    yield store, conv
    conv.close()


@pytest.mark.parametrize(
    "match, budget, on, exc",
    [
        ("turn-0003", 100, "write", ENOSPC),  # segment half written
        ("turn-0003", 0, "write", ENOSPC),  # segment: nothing written
        ("journal", 50, "write", ENOSPC),  # segment done, record half written
        ("journal", 0, "write", ENOSPC),  # segment done, no byte of the record
        ("journal", 0, "fsync", EIO),  # record written, not known to be on disk
        ("turn-0003", 0, "fsync", EIO),
    ],
)
def test_oserror_during_save_keeps_previous_turn(
    conv_with_two_turns, monkeypatch, match, budget, on, exc
):
    store, conv = conv_with_two_turns
    before = conv.manifest
    journal = (conv.path / JOURNAL).read_bytes()
    faulty = FaultyOs(match, exc, budget, on, times=1)
    monkeypatch.setattr(atomic, "os", faulty)
    with pytest.raises(SaveFailedError) as err:
        turn(conv, 3)
    assert faulty.tripped
    msg = str(err.value)
    assert "\n" not in msg
    assert f"saving turn 3 of conversation {conv.id} failed" in msg
    assert "turns 1-2 are intact" in msg
    if exc.errno == errno.ENOSPC:
        assert "No space left on device" in msg and "free some disk space" in msg
    assert isinstance(err.value.__cause__, OSError)
    assert conv.manifest is before  # in-memory state untouched: the call can be retried
    monkeypatch.undo()

    # No debris even before the next open, and the same handle can simply retry.
    assert sorted(os.listdir(conv.path / "segments")) == [
        "turn-0001.safetensors",
        "turn-0002.safetensors",
    ]
    assert (conv.path / JOURNAL).read_bytes() == journal  # a partial record was taken back
    conv.close()
    assert_state(store, conv.id, 2)
    with store.open(conv.id) as again:
        turn(again, 3)
    assert_state(store, conv.id, 3)


def test_a_disk_that_keeps_failing_fsync_keeps_the_segment_for_open_to_judge(
    conv_with_two_turns, monkeypatch
):
    """If even taking the record back cannot be made durable, the record may still be on
    disk after a power cut: its segment must then be there too. It stays, unnamed, and the
    next open removes it once the journal is seen without the record."""
    store, conv = conv_with_two_turns
    journal = (conv.path / JOURNAL).read_bytes()
    monkeypatch.setattr(atomic, "os", FaultyOs("journal", EIO, on="fsync"))
    with pytest.raises(SaveFailedError) as err:
        turn(conv, 3)
    assert "turns 1-2 are intact" in str(err.value)
    monkeypatch.undo()
    assert (conv.path / JOURNAL).read_bytes() == journal
    assert (conv.path / "segments" / "turn-0003.safetensors").exists()
    turn(conv, 3)  # the same handle retries over it
    conv.close()
    assert_state(store, conv.id, 3)


def test_the_failed_save_of_a_reopened_conversation_is_swept_at_open(
    conv_with_two_turns, monkeypatch
):
    store, conv = conv_with_two_turns
    monkeypatch.setattr(atomic, "os", FaultyOs("journal", EIO, on="fsync"))
    with pytest.raises(SaveFailedError):
        turn(conv, 3)
    monkeypatch.undo()
    conv.close()
    assert_state(store, conv.id, 2)


@pytest.mark.parametrize("match", ["turn-0003", "journal"])
def test_keyboard_interrupt_during_save_keeps_previous_turn(
    conv_with_two_turns, monkeypatch, match
):
    store, conv = conv_with_two_turns
    monkeypatch.setattr(atomic, "os", FaultyOs(match, KeyboardInterrupt(), budget=10))
    with pytest.raises(KeyboardInterrupt):
        turn(conv, 3)
    monkeypatch.undo()
    assert len(conv.manifest.turns) == 2
    turn(conv, 3)  # the handle still works
    conv.close()
    assert_state(store, conv.id, 3)


class InterruptAfterFsync(FaultyOs):
    """The journal's fsync completes, then Ctrl-C lands: after the commit point."""

    def fsync(self, fd):
        os.fsync(fd)
        if self._hit(fd):
            self.tripped = True
            raise KeyboardInterrupt


def test_interrupt_right_after_the_journal_fsync_counts_as_saved(conv_with_two_turns, monkeypatch):
    """The record's fsync is the commit point: an interrupt after it must not delete the
    segment the record names, and the handle must adopt the new turn."""
    store, conv = conv_with_two_turns
    faulty = InterruptAfterFsync("journal", KeyboardInterrupt(), on="fsync")
    monkeypatch.setattr(atomic, "os", faulty)
    with pytest.raises(KeyboardInterrupt):
        turn(conv, 3)
    assert faulty.tripped and len(conv.manifest.turns) == 3
    monkeypatch.undo()
    turn(conv, 4)
    conv.close()
    assert_state(store, conv.id, 4)


@pytest.fixture
def old_conv(tmp_path):
    """The two-turn conversation of the old format (one manifest.json), open, with its
    expected content: its first save migrates it."""
    store = ConversationStore(tmp_path)
    store.conversations_dir.mkdir(parents=True)
    shutil.copytree(FIXTURE, store.conversations_dir / FIXTURE_ID)
    conv = store.open(FIXTURE_ID)
    yield store, conv
    conv.close()


def assert_old_state(store: ConversationStore, n_turns: int) -> None:
    """Reopen the old-format conversation: its two turns, then n_turns - 2 of ``turn``."""
    with store.open(FIXTURE_ID) as conv:
        m = conv.manifest
        assert len(m.turns) == n_turns and len(m.token_ids) == 9 + 3 * (n_turns - 2)
        assert m.messages[0]["content"] == "question 1 — ünïcode"
        conv.read_turn_tensors(1)
        for i in range(3, n_turns + 1):
            got = conv.read_turn_tensors(i)
            assert all(torch.equal(got[k], v) for k, v in tensors(i).items())
        assert len(os.listdir(conv.path / "segments")) == n_turns
        names = sorted(os.listdir(conv.path))
        if n_turns == 2:  # not migrated: exactly the files it had
            assert names == ["lock", "manifest.json", "segments"]
            assert json.loads((conv.path / "manifest.json").read_text())["format_version"] == 1
        else:
            assert names == [JOURNAL, "lock", "manifest.json", "segments"]


@pytest.mark.parametrize(
    "match, budget, on, exc",
    [
        ("turn-0003", 100, "write", ENOSPC),
        ("journal", 0, "fsync", EIO),  # emptying the journal it will need
        ("manifest", 50, "write", ENOSPC),  # the new header half written
        ("manifest", 0, "fsync", EIO),
    ],
)
def test_oserror_during_the_migrating_save_keeps_the_old_conversation(
    old_conv, monkeypatch, match, budget, on, exc
):
    store, conv = old_conv
    before = conv.manifest
    original = (conv.path / "manifest.json").read_bytes()
    faulty = FaultyOs(match, exc, budget, on)
    monkeypatch.setattr(atomic, "os", faulty)
    with pytest.raises(SaveFailedError) as err:
        turn(conv, 3)
    assert faulty.tripped and "turns 1-2 are intact" in str(err.value)
    assert conv.manifest is before
    monkeypatch.undo()
    assert (conv.path / "manifest.json").read_bytes() == original
    assert len(os.listdir(conv.path / "segments")) == 2
    turn(conv, 3)  # the same handle retries
    conv.close()
    assert_old_state(store, 3)


def test_interrupt_right_after_the_migrating_rename_counts_as_saved(old_conv, monkeypatch):
    """The header's rename is the commit point of a migrating save: an interrupt after it
    must not delete the new segment, and the handle must adopt the new header."""
    store, conv = old_conv
    real = atomic.fsync_dir
    renamed = []

    def fsync_dir(path):
        real(path)
        if Path(path) == conv.path and (conv.path / JOURNAL).exists():
            renamed.append(path)
            if len(renamed) == 2:  # the first makes the emptied journal durable
                raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "fsync_dir", fsync_dir)
    with pytest.raises(KeyboardInterrupt):
        turn(conv, 3)
    assert len(conv.manifest.turns) == 3 and conv.manifest.format_version == 2
    monkeypatch.undo()
    turn(conv, 4)  # appended to the journal the migration left
    conv.close()
    assert_old_state(store, 4)


def test_a_directory_fsync_error_after_the_migrating_rename_is_not_a_failed_save(
    old_conv, monkeypatch
):
    store, conv = old_conv
    real = atomic.fsync_dir
    calls = []

    def fsync_dir_fails(path):
        if Path(path) == conv.path:
            calls.append(path)
            if len(calls) == 2:  # after the header's rename
                raise OSError(errno.EIO, "Input/output error")
        real(path)

    monkeypatch.setattr(atomic, "fsync_dir", fsync_dir_fails)
    turn(conv, 3)
    monkeypatch.undo()
    assert len(calls) == 2
    conv.close()
    assert_old_state(store, 3)


def run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


KILLED_CHILD = """
    import os, sys, torch
    from kvchat.storage import ConversationStore, atomic
    conv = ConversationStore(sys.argv[1]).open(sys.argv[2])
    names = {}
    real_open, real_write, real_replace = os.open, os.write, os.replace
    def open_(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        names[fd] = os.path.basename(path)
        return fd
    def write(fd, data):
        if names.get(fd) == sys.argv[3]:
            real_write(fd, bytes(data[: len(data) // 2]))
            os._exit(17)  # dies like a power cut half-way through: no cleanup, no finally
        return real_write(fd, data)
    def replace(src, dst):
        if os.path.basename(dst) == sys.argv[3]:
            os._exit(17)
        real_replace(src, dst)
    atomic.os.open, atomic.os.write, atomic.os.replace = open_, write, replace
    conv.append_turn(messages=[], token_ids=[1], tensors={"x": torch.zeros(1000)})
"""


def test_process_killed_half_way_through_the_record(conv_with_two_turns):
    store, conv = conv_with_two_turns
    conv.close()
    journal = (conv.path / JOURNAL).read_bytes()
    done = run_python(KILLED_CHILD, str(store.root), conv.id, JOURNAL)
    assert done.returncode == 17, done.stderr
    assert "turn-0003.safetensors" in os.listdir(conv.path / "segments")  # the orphan segment
    torn = (conv.path / JOURNAL).read_bytes()
    assert len(torn) > len(journal) and torn.startswith(journal)  # a torn record
    assert [r.turns for r in store.list()] == [2]
    assert_state(store, conv.id, 2)  # open() removed both
    assert (conv.path / JOURNAL).read_bytes() == journal


def test_process_killed_between_segment_and_the_migrating_rename(old_conv):
    store, conv = old_conv
    conv.close()
    done = run_python(KILLED_CHILD, str(store.root), FIXTURE_ID, "manifest.json")
    assert done.returncode == 17, done.stderr
    left = set(os.listdir(conv.path / "segments")) | set(os.listdir(conv.path))
    assert "turn-0003.safetensors" in left  # the orphan segment
    assert any(atomic.is_temp_name(n) for n in left)  # the unrenamed header
    assert_old_state(store, 2)  # open() removed all of it, the emptied journal too


TINY_FS_CHILD = """
    import os, sys, torch
    from kvchat.storage import ConversationStore, SaveFailedError
    store = ConversationStore(sys.argv[1])
    conv = store.create(model_name="m", fingerprint="fp", dtype="float32", settings={})
    big = {"h": torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256)}  # 256 KiB
    saved = 0
    try:
        for i in range(20):
            conv.append_turn(messages=[], token_ids=[i], tensors=big)
            saved += 1
        sys.exit("the filesystem never filled up")
    except SaveFailedError as e:
        msg = str(e)
    assert "No space left on device" in msg, msg
    assert saved >= 1, saved
    conv.close()
    with store.open(conv.id) as again:
        assert len(again.manifest.turns) == saved
        for i in range(1, saved + 1):
            assert torch.equal(again.read_turn_tensors(i)["h"], big["h"])
        assert len(os.listdir(again.path / "segments")) == saved
    print("OK", saved, msg)
"""


def test_disk_full_on_a_real_tiny_filesystem(tmp_path):
    """A 1 MiB tmpfs mounted in an unprivileged user+mount namespace (no root needed where
    the kernel allows user namespaces); skipped where it does not."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        pytest.skip("needs Linux unshare(1)")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(TINY_FS_CHILD))
    shell = 'mount -t tmpfs -o size=1m tmpfs "$1" || exit 99; exec "$2" "$3" "$1"'
    done = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", shell, "sh"]
        + [str(mnt), sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode == 99 or (done.returncode != 0 and "unshare:" in done.stderr):
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("OK ")
