"""Atomic replacement: the target is old-or-new, never partial, and no temp file lingers."""

from __future__ import annotations

import errno
import os

import pytest

from kvchat.storage import atomic


class FailingOs:
    """Stands in for ``os`` inside kvchat.storage.atomic only; os.write fails after a budget."""

    def __init__(self, budget: int, exc: BaseException):
        self.budget = budget
        self.exc = exc

    def write(self, fd, data):
        if self.budget <= 0:
            raise self.exc
        n = os.write(fd, bytes(data[: self.budget]))
        self.budget -= n
        return n

    def __getattr__(self, name):
        return getattr(os, name)


def test_creates_and_replaces(tmp_path):
    target = tmp_path / "f.bin"
    atomic.write_atomic(target, b"one")
    atomic.write_text_atomic(target, "twö")
    assert target.read_text("utf-8") == "twö"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_large_write_is_complete(tmp_path):
    data = os.urandom(3 * (8 << 20) + 17)  # several chunks
    atomic.write_atomic(tmp_path / "big", data)
    assert (tmp_path / "big").read_bytes() == data


@pytest.mark.parametrize(
    "exc", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()]
)
def test_failure_partway_keeps_old_file_and_removes_temp(tmp_path, monkeypatch, exc):
    target = tmp_path / "f.bin"
    atomic.write_atomic(target, b"old contents")
    monkeypatch.setattr(atomic, "os", FailingOs(budget=5, exc=exc))
    with pytest.raises(type(exc)):
        atomic.write_atomic(target, b"new contents that will not fit")
    assert target.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_temp_names_are_recognisable():
    assert atomic.is_temp_name(".manifest.json.tmp-12-abcd")
    assert not atomic.is_temp_name("manifest.json")
    assert not atomic.is_temp_name("turn-0001.safetensors")
