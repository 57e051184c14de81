"""Failures during a save: disk full, I/O errors, Ctrl-C, a killed process, a full filesystem.

In every case the conversation must still open exactly as it was after the previous turn.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvchat.storage import ConversationStore, SaveFailedError, atomic

REPO = Path(__file__).resolve().parents[2]
ENOSPC = OSError(errno.ENOSPC, "No space left on device")


class FaultyOs:
    """Replaces ``os`` inside kvchat.storage.atomic only. Writes to (or fsyncs of) files whose
    name contains ``match`` raise ``exc`` once ``budget`` bytes of them have been written,
    after really writing those bytes: a partial file is left, as on a real full disk."""

    def __init__(self, match: str, exc: BaseException, budget: int = 0, on: str = "write"):
        self.match, self.exc, self.budget, self.on = match, exc, budget, on
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
        if self.on == "fsync" and self._hit(fd):
            self.tripped = True
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
        assert sorted(os.listdir(conv.path)) == ["lock", "manifest.json", "segments"]


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
        ("manifest", 50, "write", ENOSPC),  # segment done, manifest half written
        ("manifest", 0, "fsync", OSError(errno.EIO, "Input/output error")),
        ("turn-0003", 0, "fsync", OSError(errno.EIO, "Input/output error")),
    ],
)
def test_oserror_during_save_keeps_previous_turn(
    conv_with_two_turns, monkeypatch, match, budget, on, exc
):
    store, conv = conv_with_two_turns
    before = conv.manifest
    faulty = FaultyOs(match, exc, budget, on)
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
    conv.close()
    assert_state(store, conv.id, 2)
    with store.open(conv.id) as again:
        turn(again, 3)
    assert_state(store, conv.id, 3)


@pytest.mark.parametrize("match", ["turn-0003", "manifest"])
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


def test_interrupt_right_after_the_manifest_rename_counts_as_saved(
    conv_with_two_turns, monkeypatch
):
    """The rename is the commit point: an interrupt after it must not delete the segment the
    new manifest names, and the handle must adopt the new manifest."""
    store, conv = conv_with_two_turns
    real = atomic.fsync_dir

    def fsync_dir(path):
        real(path)
        if Path(path) == conv.path:  # the manifest's folder, i.e. after the manifest rename
            raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "fsync_dir", fsync_dir)
    with pytest.raises(KeyboardInterrupt):
        turn(conv, 3)
    assert len(conv.manifest.turns) == 3

    def fsync_dir_fails(path):
        if Path(path) == conv.path:
            raise OSError(errno.EIO, "Input/output error")
        real(path)

    monkeypatch.setattr(atomic, "fsync_dir", fsync_dir_fails)
    turn(conv, 4)  # a directory fsync error after the rename is not a failed save
    monkeypatch.undo()
    conv.close()
    assert_state(store, conv.id, 4)


def run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_process_killed_between_segment_and_manifest(conv_with_two_turns):
    store, conv = conv_with_two_turns
    conv.close()
    child = """
        import os, sys, torch
        from kvchat.storage import ConversationStore, atomic
        conv = ConversationStore(sys.argv[1]).open(sys.argv[2])
        real_replace = os.replace
        def replace(src, dst):
            if os.path.basename(dst) == "manifest.json":
                os._exit(17)  # dies like a power cut: no cleanup, no finally
            real_replace(src, dst)
        atomic.os.replace = replace
        conv.append_turn(messages=[], token_ids=[1], tensors={"x": torch.zeros(1000)})
    """
    done = run_python(child, str(store.root), conv.id)
    assert done.returncode == 17, done.stderr
    left = set(os.listdir(conv.path / "segments")) | set(os.listdir(conv.path))
    assert "turn-0003.safetensors" in left  # the orphan segment
    assert any(atomic.is_temp_name(n) for n in left)  # the unrenamed manifest
    assert_state(store, conv.id, 2)  # open() removed both


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
