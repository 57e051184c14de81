"""The real app in a real terminal: tmux, the real default model, keys typed with send-keys.

Starts ``kvchat --model <dir> --max-mem 64MB`` (through ``python -m kvchat.cli`` so it runs this
checkout's code with this interpreter) in a detached 100x30 tmux session, asks a question,
waits for the reply, captures the pane, checks the gauge and the reply, then quits with
Ctrl+Q and checks the exit status. Skipped when tmux is not installed.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

REPO = Path(__file__).resolve().parents[2]


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def wait_for(session: str, *needles: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = tmux("capture-pane", "-p", "-t", session)
        if all(n in screen for n in needles):
            return screen
        if "Traceback" in screen:
            break
        time.sleep(0.1)
    raise AssertionError(f"waited {timeout} s for {needles!r}; the screen was:\n{screen}")


def test_chat_in_a_real_terminal(smollm2_dir, tmp_path):
    session = f"kvchat-test-{uuid.uuid4().hex[:8]}"
    command = " ".join(
        [
            "cd", shlex.quote(str(REPO)), "&&",
            "env", f"KVCHAT_DATA_DIR={shlex.quote(str(tmp_path / 'data'))}", "TERM=xterm-256color",
            shlex.quote(sys.executable), "-m", "kvchat.cli",
            "--model", shlex.quote(str(smollm2_dir)), "--device", "cpu", "--max-mem", "64MB",
            "; echo KVCHAT_EXIT=$?; sleep 60",
        ]
    )  # fmt: skip
    start = time.monotonic()
    tmux("new-session", "-d", "-s", session, "-x", "100", "-y", "30", command)
    try:
        wait_for(session, "kvchat · ", timeout=20)
        first_frame = time.monotonic() - start
        wait_for(session, "ready │", timeout=180)
        tmux("send-keys", "-t", session, "-l", "What is the capital of France?")
        tmux("send-keys", "-t", session, "Enter")
        screen = wait_for(session, "Paris", "tok/s", timeout=180)
        (tmp_path / "screen.txt").write_text(screen)
        print(f"first frame after {first_frame:.2f} s (python start included)\n{screen}")
        assert "What is the capital of France?" in screen
        assert "─memory" in screen
        lines = screen.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("─memory"))
        gauge, standard, tokens = lines[at + 1 : at + 4]
        assert gauge.startswith(" kvchat ") and "/ 61.0 MiB" in gauge and "weights" in gauge
        assert standard.startswith(" standard ") and "MiB" in standard and "RSS" in standard
        assert "tokens:" in tokens and "hot" in tokens and "checkpointed" in tokens
        assert "Traceback" not in screen
        tmux("send-keys", "-t", session, "C-q")
        wait_for(session, "KVCHAT_EXIT=0", timeout=20)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
