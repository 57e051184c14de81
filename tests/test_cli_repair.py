"""`kvchat repair ID`: the command a damaged segment's message points to (real SmolLM2)."""

from __future__ import annotations

import json

import pytest

from tests.test_cli import kvchat_here as kvchat

pytestmark = pytest.mark.slow


def _flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_repair_rebuilds_a_damaged_turn_and_resume_then_continues_as_before(tmp_path):
    data = str(tmp_path)
    common = ("--data-dir", data, "--max-new-tokens", "8", "--max-mem", "1MB")
    out = kvchat("run", *common, "--prompt", "Hi there", "--prompt", "Name a colour", "--json")
    assert out.returncode == 0, out.stderr
    conv_id = json.loads(out.stdout.splitlines()[-1])["conversation"]
    segments = tmp_path / "conversations" / conv_id / "segments"
    reference = kvchat("resume", conv_id, *common[:2], "--prompt", "And another?", "--json")
    assert reference.returncode == 0, reference.stderr
    expected = json.loads(reference.stdout.splitlines()[-1])["tokens"]

    # The same two turns again, then damage turn 1.
    out = kvchat("run", *common, "--prompt", "Hi there", "--prompt", "Name a colour", "--json")
    conv_id = json.loads(out.stdout.splitlines()[-1])["conversation"]
    segments = tmp_path / "conversations" / conv_id / "segments"
    _flip_last_byte(segments / "turn-0001.safetensors")
    broken = kvchat("resume", conv_id, *common[:2], "--prompt", "And another?")
    assert broken.returncode == 1
    assert f"run `kvchat repair {conv_id}`" in broken.stderr
    assert "Traceback" not in broken.stderr

    fixed = kvchat("repair", conv_id[:15], "--data-dir", data)
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.strip() == (
        f"repaired conversation {conv_id}: rebuilt turn 1; checked against the intact "
        "turn 2: identical"
    )
    again = kvchat("repair", conv_id, "--data-dir", data)
    assert "nothing to repair" in again.stdout

    resumed = kvchat("resume", conv_id, *common[:2], "--prompt", "And another?", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.splitlines()[-1])["tokens"] == expected


def test_repair_rebuilds_under_the_thread_counts_the_turns_were_computed_with(tmp_path):
    """A conversation records the thread counts its turns ran on, and repair rebuilds under
    them, whatever today's default. (Thread counts can change bits: one-row SDPA over 600
    keys differs on one thread and two here, and so does a 7-row fp32 GEMM; this short
    conversation does not reach such a shape, so it shows the record and its use, not a
    refusal without it.)"""
    data = str(tmp_path)
    common = ("--data-dir", data, "--max-new-tokens", "8")
    out = kvchat(
        "run", *common, "--threads", "2", "--decode-threads", "2",
        "--prompt", "Hi there", "--prompt", "Name a colour", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    conv_id = json.loads(out.stdout.splitlines()[-1])["conversation"]
    header = json.loads((tmp_path / "conversations" / conv_id / "manifest.json").read_text())
    assert header["settings"]["threads"] == header["settings"]["decode_threads"] == 2
    _flip_last_byte(tmp_path / "conversations" / conv_id / "segments" / "turn-0001.safetensors")
    fixed = kvchat("repair", conv_id, "--data-dir", data)
    assert fixed.returncode == 0, fixed.stderr
    assert "checked against the intact turn 2: identical" in fixed.stdout


def test_repair_of_an_unknown_id_is_one_line(tmp_path):
    out = kvchat("repair", "nope", "--data-dir", str(tmp_path))
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "nope" in out.stderr
