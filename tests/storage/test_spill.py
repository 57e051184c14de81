"""Spill folders of sessions: what they hold, and sweeping those whose process is gone."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from kvchat.storage.spill import (
    create_spill_folder,
    spill_folders,
    spill_usage,
    stale_spill_usage,
    sweep_stale_spill,
)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def live_pid():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child.pid
    child.kill()
    child.wait()


def folder(data_dir, name: str, nbytes: int):
    path = data_dir / "spill" / name
    path.mkdir(parents=True)
    (path / "L0.bin").write_bytes(b"x" * nbytes)
    return path


def test_stale_folders_are_counted_and_swept_live_ones_kept(tmp_path, live_pid):
    data = tmp_path / "data"
    gone = folder(data, f"{dead_pid()}-abcd1234", 1000)
    live = folder(data, f"{live_pid}-00ff00ff", 500)
    mine = folder(data, f"{os.getpid()}-12345678", 200)
    other = folder(data, "notes", 10)  # not a session folder: counted, never swept
    assert spill_usage(data) == 1710
    assert stale_spill_usage(data) == 1000
    assert {f.path.name: f.stale for f in spill_folders(data)} == {
        gone.name: True,
        live.name: False,
        mine.name: False,
        other.name: False,
    }
    assert sweep_stale_spill(data) == 1000
    assert not gone.exists() and live.exists() and mine.exists() and other.exists()
    assert sweep_stale_spill(data) == 0
    assert spill_usage(data) == 710


def test_a_reused_pid_does_not_keep_a_folder_alive(tmp_path, live_pid):
    data = tmp_path / "data"
    old = folder(data, f"{live_pid}-abcd1234", 300)
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))  # last changed before that process started
    assert stale_spill_usage(data) == 300
    assert sweep_stale_spill(data) == 300 and not old.exists()


def test_links_are_never_followed(tmp_path):
    data = tmp_path / "data"
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    (data / "spill").mkdir(parents=True)
    os.symlink(target, data / "spill" / f"{dead_pid()}-abcd")
    assert spill_usage(data) == 0
    sweep_stale_spill(data)
    assert os.listdir(data / "spill") == [] and (target / "keep.txt").read_text() == "keep"

    linked = tmp_path / "linked"
    (tmp_path / "spill-elsewhere" / f"{dead_pid()}-abcd").mkdir(parents=True)
    (linked).mkdir()
    os.symlink(tmp_path / "spill-elsewhere", linked / "spill")
    assert spill_usage(linked) == 0 and sweep_stale_spill(linked) == 0
    assert len(os.listdir(tmp_path / "spill-elsewhere")) == 1
    with pytest.raises(OSError):
        create_spill_folder(linked)


def test_no_spill_folder_at_all(tmp_path):
    assert spill_usage(tmp_path / "nothing") == 0
    assert sweep_stale_spill(tmp_path / "nothing") == 0
    (tmp_path / "file").write_text("x")
    assert spill_usage(tmp_path / "file") == 0


def test_create_is_private_whatever_the_umask_and_sweeps_first(tmp_path):
    data = tmp_path / "data"
    gone = folder(data, f"{dead_pid()}-abcd1234", 1000)
    previous = os.umask(0)
    try:
        made = create_spill_folder(tmp_path / "fresh")
        assert stat.S_IMODE(os.lstat(made).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(made.parent).st_mode) == 0o700
        assert made.name.startswith(f"{os.getpid()}-")
        create_spill_folder(data)
        assert not gone.exists()
    finally:
        os.umask(previous)
