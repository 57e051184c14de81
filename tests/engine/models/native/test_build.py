"""Building the C++ decode layers (``kvchat.engine.models.native.build``): cached per torch and
source, never retried after a failure, retried after a kill, finished even when kvchat
exits first, off on request, and never in the way."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from kvchat.engine.models.native import build


@pytest.fixture()
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_off_when_asked(private_cache, monkeypatch):
    monkeypatch.setenv("KVCHAT_NATIVE", "0")
    assert build.library_path() is None
    assert build.start() is None
    assert not any(private_cache.iterdir())


def test_without_a_compiler_nothing_is_built(private_cache, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert build.start() is None
    assert not any(private_cache.iterdir())


def fake_compiler(tmp_path, name, body):
    script = tmp_path / name
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def failing_compiler(tmp_path):
    return fake_compiler(
        tmp_path, "bad-cxx", "echo 'fatal error: torch/library.h: No such file'\nexit 1\n"
    )


# A compiler that takes a while, then writes its output file (the argument after -o).
SLOW_COMPILER = """
while [ "$#" -gt 0 ]; do
  if [ "$1" = "-o" ]; then out=$2; fi
  shift
done
sleep 2
printf 'not really a library' >"$out"
"""


@pytest.mark.skipif(os.name != "posix", reason="a shell-script compiler")
def test_a_build_killed_by_a_signal_leaves_nothing_and_runs_again(private_cache, monkeypatch):
    monkeypatch.setenv("CXX", str(fake_compiler(private_cache, "killed-cxx", "kill -9 $$\n")))
    started = build.start()
    assert started is not None
    assert started.wait(60) is None
    native = started.target.parent
    assert not started.failed_marker.exists()
    assert not list(native.glob("*.tmp")) and not list(native.glob("*.log"))
    again = build.start()
    assert again is not None and again.process is not None  # tried again
    again.wait(60)


@pytest.mark.skipif(os.name != "posix", reason="a shell-script compiler")
@pytest.mark.slow
def test_a_build_lands_even_when_the_process_that_started_it_has_exited(private_cache, monkeypatch):
    compiler = fake_compiler(private_cache, "slow-cxx", SLOW_COMPILER)
    monkeypatch.setenv("CXX", str(compiler))
    target = build.library_path()
    code = "from kvchat.engine.models.native import build; print(build.start().process.pid)"
    started = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert int(started.stdout)  # the starting process is gone; its build goes on
    deadline = time.monotonic() + 60
    while not target.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert target.read_text() == "not really a library"
    assert not list(target.parent.glob("*.tmp")) and not list(target.parent.glob("*.log"))


@pytest.mark.skipif(os.name != "posix", reason="a shell-script compiler")
def test_a_failed_build_is_recorded_with_its_output_and_not_retried(private_cache, monkeypatch):
    monkeypatch.setenv("CXX", str(failing_compiler(private_cache)))
    started = build.start()
    assert started is not None
    assert started.wait(60) is None
    marker = started.target.with_suffix(".failed")
    assert "No such file" in marker.read_text()
    assert not started.target.exists()
    assert not list(marker.parent.glob("*.tmp")) and not list(marker.parent.glob("*.log"))
    assert build.start() is None  # not retried for this key


def test_the_key_follows_the_source_and_the_compiler(private_cache, monkeypatch, tmp_path):
    first = build.library_path()
    if first is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("CXX", str(failing_compiler(tmp_path)))
    assert build.library_path() != first
    monkeypatch.delenv("CXX")
    source = tmp_path / "decode_layer.cpp"
    source.write_text(build.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(build, "SOURCE", source)
    assert build.library_path() != first


@pytest.mark.slow
def test_a_real_build_lands_in_the_cache_and_is_found_again(private_cache):
    if build.library_path() is None:
        pytest.skip("no C++ compiler")
    started = build.start()
    path = started.wait(300)
    assert path is not None and path.exists() and path.parent == private_cache / "native"
    again = build.start()
    assert again is not None and again.process is None and again.wait() == path


def test_an_unwritable_cache_builds_nothing_and_raises_nothing(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(blocker))
    if build.library_path() is None:
        pytest.skip("no C++ compiler")
    assert build.start() is None
