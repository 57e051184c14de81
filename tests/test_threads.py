"""Threads that share the machine: passive OpenMP waiting and one thread per physical core."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
import torch

from kvchat.threads import (
    SMALL_WEIGHTS,
    apply_threads,
    decode_threads_for,
    default_threads,
    prefer_passive_wait,
    rows_threads,
    set_decode_threads,
    threads_for_rows,
)


def test_the_suite_itself_waits_passively() -> None:
    # conftest sets it before torch is imported, unless whoever runs the suite chose one.
    assert os.environ.get("OMP_WAIT_POLICY", "").upper() in {"PASSIVE", "ACTIVE"}


def test_passive_wait_is_set_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    prefer_passive_wait()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    prefer_passive_wait()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_passive_wait_spins_briefly_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvchat.threads import SPIN_COUNT

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    prefer_passive_wait()
    assert os.environ["GOMP_SPINCOUNT"] == SPIN_COUNT == "1000"

    monkeypatch.setenv("GOMP_SPINCOUNT", "0")  # the user's count wins
    prefer_passive_wait()
    assert os.environ["GOMP_SPINCOUNT"] == "0"

    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # an active policy spins as it likes
    prefer_passive_wait()
    assert "GOMP_SPINCOUNT" not in os.environ


def test_default_threads_are_the_physical_cores_we_may_use() -> None:
    physical = psutil.cpu_count(logical=False) or os.cpu_count()
    assert default_threads() == min(physical, len(os.sched_getaffinity(0)))


def test_apply_threads_sets_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        assert apply_threads(1) == 1 and torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert apply_threads(None) == default_threads() == torch.get_num_threads()
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert apply_threads(None) == 1
    finally:
        torch.set_num_threads(before)


def test_cli_entry_sets_passive_wait_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    probe = (
        "import sys, os\n"
        "sys.argv = ['kvchat', '--help']\n"
        "from kvchat.cli import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('POLICY', os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'),"
        " 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    # set, and torch not even imported for --help (it stays instant)
    assert "POLICY PASSIVE 1000 False" in out.stdout, out.stderr


def test_threads_option_is_offered() -> None:
    from click.testing import CliRunner

    from kvchat.cli import cli

    result = CliRunner().invoke(cli, ["run", "--help"])
    assert result.exit_code == 0 and "--threads" in result.output
    assert "--decode-threads" in result.output


def test_small_weights_decode_on_one_thread_others_on_all() -> None:
    assert decode_threads_for(91 * 2**20, 2) == 1  # SmolLM2-135M int4
    assert decode_threads_for(SMALL_WEIGHTS, 8) == 1
    assert decode_threads_for(513 * 2**20, 2) == 2  # its float32 weights
    assert decode_threads_for(2 * 2**30, 8) == 8


def test_a_call_runs_on_the_count_of_its_rows_and_gives_the_old_count_back() -> None:
    before = torch.get_num_threads()
    try:
        apply_threads(2)
        set_decode_threads(1)
        assert threads_for_rows(1) == 1 and threads_for_rows(256) == 2
        torch.set_num_threads(2)
        with rows_threads(1):
            assert torch.get_num_threads() == 1
            with rows_threads(7):  # a replay of a prefill chunk inside a decode step
                assert torch.get_num_threads() == 2
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        set_decode_threads(None)
        assert threads_for_rows(1) == 2
        with pytest.raises(ValueError):
            set_decode_threads(0)
    finally:
        set_decode_threads(None)
        apply_threads(before)


@pytest.mark.slow
def test_loading_sets_the_decode_count(smollm2_dir) -> None:
    from kvchat.engine.models.load import load

    before = torch.get_num_threads()
    try:
        loaded = load(str(smollm2_dir), weights="int4", threads=2)
        assert loaded.weights_bytes <= SMALL_WEIGHTS
        assert threads_for_rows(1) == 1 and threads_for_rows(2) == 2
        load(str(smollm2_dir), weights="int4", threads=2, decode_threads=2)
        assert threads_for_rows(1) == 2
    finally:
        set_decode_threads(None)
        apply_threads(before)
