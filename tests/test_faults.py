"""Faults, end to end through the real CLI: Ctrl-C while replying and while saving, two
processes on one conversation, a corrupted segment file.

Every test starts from a copy of one saved two-turn conversation (made once per module by
``kvchat run``) in its own data dir, drives ``python -m kvchat.cli`` subprocesses against it
(``KVCHAT_DATA_DIR`` pointing there), and then checks what a user would rely on: the
completed turns are intact (``kvchat export``), ``kvchat list`` still works, the
conversation opens (its lock, manifest and segment checksums), no temporary files or
unreferenced segments remain, and whatever went wrong was said in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FIRST_TURNS = ("What is the capital of France?", "And of Italy?")
# After FIRST_TURNS, SmolLM2 answers both with 200+ greedy tokens (checked): long replies.
ESSAY = "Write a long essay about the history of Europe."
STORY = "Write a very long story about a ship and its crew."


# -- helpers ----------------------------------------------------------------------------------
def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "KVCHAT_DATA_DIR": str(root)}


def kvchat(root: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvchat.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(root),
    )


class Running:
    """A ``kvchat`` process whose stdout is collected by a thread, so waits can time out."""

    def __init__(self, root: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvchat.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(root),
        )
        self._out: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := self.proc.stdout.read(1):
            self._out.append(chunk)

    @property
    def stdout(self) -> str:
        return "".join(self._out)

    def wait_for(self, ready, timeout: float = 120, what: str = "output") -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                pytest.fail(f"kvchat exited ({self.proc.returncode}) before {what}: {self.err()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"no {what} after {timeout} s")
            time.sleep(0.002)

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._reader.join(timeout=10)
        return self.proc.returncode, self.stdout, self.err()

    def err(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read()


def listing(root: Path) -> list[dict]:
    out = kvchat(root, "list", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["conversations"]


def exported(root: Path, conv_id: str) -> list[dict]:
    out = kvchat(root, "export", conv_id, "--format", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["messages"]


def conversation_dir(root: Path, conv_id: str) -> Path:
    return root / "conversations" / conv_id


def debris(root: Path, conv_id: str) -> list[str]:
    """Temporary files, and segment files the manifest does not name."""
    from kvchat.storage.atomic import is_temp_name
    from kvchat.storage.folder import read_manifest

    path = conversation_dir(root, conv_id)
    named = {turn.segment.file for turn in read_manifest(path).turns}
    found = [n for n in os.listdir(path) if is_temp_name(n)]
    for name in os.listdir(path / "segments"):
        if is_temp_name(name) or name not in named:
            found.append(f"segments/{name}")
    return found


def opens_and_verifies(root: Path, conv_id: str) -> int:
    """Open the conversation as resume does (lock, manifest, debris sweep), check every
    segment's checksum; returns the number of turns."""
    from kvchat.storage import ConversationStore

    with ConversationStore(root).open(conv_id) as conversation:
        for turn in conversation.manifest.turns:
            conversation.read_turn_tensors(turn.index)
        return len(conversation.manifest.turns)


def error_lines(stderr: str) -> list[str]:
    """The lines a user reads as the outcome: not the progress lines kvchat prints."""
    return [
        line
        for line in stderr.splitlines()
        if line.strip() and not line.startswith(("kvchat: resumed", "[mem]", "kvchat: loading"))
    ]


# -- the saved conversation every test starts from --------------------------------------------
@pytest.fixture(scope="module")
def saved(smollm2_dir, tmp_path_factory):
    """A two-turn conversation saved by ``kvchat run``: (data dir, id, its messages)."""
    root = tmp_path_factory.mktemp("faults-saved")
    prompts = [a for p in FIRST_TURNS for a in ("--prompt", p)]
    out = kvchat(
        root, "run", "--model", str(smollm2_dir), "--json", "--max-new-tokens", "8", *prompts
    )
    assert out.returncode == 0, out.stderr
    conv_id = json.loads(out.stdout.splitlines()[-1])["conversation"]
    messages = exported(root, conv_id)
    assert [m["content"] for m in messages if m["role"] == "user"] == list(FIRST_TURNS)
    return root, conv_id, messages


@pytest.fixture
def copy(saved, tmp_path):
    """A private copy of the saved conversation: (data dir, id, its messages)."""
    root, conv_id, messages = saved
    mine = tmp_path / "data"
    shutil.copytree(root, mine)
    return mine, conv_id, messages


def _user_prompts(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


# -- a. Ctrl-C while the reply is streaming ---------------------------------------------------
def test_ctrl_c_while_replying_keeps_every_turn(copy, smollm2_dir):
    root, conv_id, before = copy
    run = Running(
        root, "run", "--model", str(smollm2_dir), "--conversation", conv_id,
        "--max-new-tokens", "300", "--prompt", ESSAY,
    )  # fmt: skip
    run.wait_for(lambda: len(run.stdout.split()) >= 3, what="a streamed reply")
    run.proc.send_signal(signal.SIGINT)
    code, out, err = run.finish()

    assert code == 130, err
    assert out.rstrip().endswith("[stopped]")
    assert "Traceback" not in err and error_lines(err) == []
    [row] = listing(root)
    assert row["id"] == conv_id and row["turns"] == 3 and row["error"] is None
    messages = exported(root, conv_id)
    assert messages[:4] == before  # the completed turns, untouched
    assert _user_prompts(messages) == [*FIRST_TURNS, ESSAY]
    reply = messages[5]["content"]
    assert messages[5]["role"] == "assistant" and reply and reply[:10] in out  # what was said
    assert opens_and_verifies(root, conv_id) == 3
    assert debris(root, conv_id) == []


# -- b. Ctrl-C while the turn is being saved --------------------------------------------------
def _long_prompt(words: int) -> str:
    """About ``words`` tokens of text: a big turn, so its segment takes a while to write."""
    phrases = ("the sea", "a ship", "red sky", "old map")
    return " ".join(phrases[i % 4] for i in range(words // 2)) + "\nSummarize this in a word."


def _interrupt_during_save(
    root: Path, conv_id: str, smollm2_dir: Path, burst: bool, *more: str
) -> tuple[Running, int]:
    """Start a turn with a big segment; SIGINT once (``burst`` False) or every 5 ms
    (``burst`` True) while the segment's temporary file exists. Returns the process and
    how many signals were sent while a save was in progress."""
    from kvchat.storage.atomic import is_temp_name

    segments_dir = conversation_dir(root, conv_id) / "segments"
    run = Running(
        root, "run", "--model", str(smollm2_dir), "--conversation", conv_id,
        "--max-new-tokens", "1", "--prompt", _long_prompt(600), *more,
    )  # fmt: skip
    saving = lambda: any(is_temp_name(n) for n in os.listdir(segments_dir))  # noqa: E731
    run.wait_for(saving, timeout=180, what="a save in progress (a temporary segment file)")
    sent = 0
    while saving() and (burst or sent == 0):
        run.proc.send_signal(signal.SIGINT)
        sent += 1
        time.sleep(0.005)
    return run, sent


def test_ctrl_c_burst_while_saving_leaves_a_consistent_store(copy, smollm2_dir):
    """Repeated Ctrl-C while a turn's segment is being written: the second one interrupts
    the save (the first only asks the reply to stop, and the reply is already over). Either
    the save is abandoned (the turn is lost, nothing half-written remains) or it completed
    first; in both cases the earlier turns are intact and the conversation resumes."""
    root, conv_id, before = copy
    run, sent = _interrupt_during_save(root, conv_id, smollm2_dir, burst=True)
    code, out, err = run.finish()
    assert sent >= 1
    assert "Traceback" not in err and "Exception ignored" not in err
    outcome = error_lines(err)
    assert len(outcome) <= 1, err  # at most one line says what happened
    [row] = listing(root)
    saved_turns = row["turns"]
    assert row["error"] is None and saved_turns in (2, 3)
    if saved_turns == 2:  # the save was interrupted: one line says what is kept, exit 130
        assert code == 130 and len(outcome) == 1, (code, err)
        assert "interrupted" in outcome[0] and "2 saved turn(s)" in outcome[0], err
    messages = exported(root, conv_id)
    assert messages[:4] == before and len(messages) == 2 * saved_turns

    again = kvchat(
        root, "resume", conv_id, "--model", str(smollm2_dir), "--json",
        "--max-new-tokens", "3", "--prompt", "Thanks!",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["turn"] == 1  # first turn of this process
    assert debris(root, conv_id) == []
    assert listing(root)[0]["turns"] == saved_turns + 1
    assert exported(root, conv_id)[: 2 * saved_turns] == messages
    assert opens_and_verifies(root, conv_id) == saved_turns + 1


def test_one_ctrl_c_while_saving_finishes_the_save_then_stops(copy, smollm2_dir):
    root, conv_id, before = copy
    run, sent = _interrupt_during_save(
        root, conv_id, smollm2_dir, False, "--prompt", "And one more thing?"
    )
    code, out, err = run.finish()
    assert sent == 1 and "Traceback" not in err
    # the turn being saved is kept, and nothing more is answered
    assert listing(root)[0]["turns"] == 3
    assert exported(root, conv_id)[:4] == before
    assert debris(root, conv_id) == []
    assert code == 130, (code, err)


# -- c. two processes on one conversation -----------------------------------------------------
def test_a_second_process_is_refused_while_the_first_replies(copy, smollm2_dir):
    root, conv_id, before = copy
    lock = conversation_dir(root, conv_id) / "lock"
    first = Running(
        root, "run", "--model", str(smollm2_dir), "--conversation", conv_id,
        "--max-new-tokens", "200", "--prompt", STORY,
    )  # fmt: skip
    holds = lambda: lock.read_text().strip() == str(first.proc.pid)  # noqa: E731
    first.wait_for(holds, what="the first process holding the conversation's lock")

    # Stopped, the first keeps its lock however long the second takes to start (under a
    # busy CI the first's reply could otherwise end before the second looks).
    os.kill(first.proc.pid, signal.SIGSTOP)
    try:
        second = kvchat(
            root, "run", "--model", str(smollm2_dir), "--conversation", conv_id, "--json",
            "--max-new-tokens", "2", "--prompt", "Hi",
        )  # fmt: skip
    finally:
        os.kill(first.proc.pid, signal.SIGCONT)
    assert first.proc.poll() is None, (
        f"the first process ended before the second tried: {first.stdout!r} {second.stderr!r}"
    )
    assert second.returncode == 1 and second.stdout == ""
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert lines[0].startswith("kvchat: error:") and "open in another kvchat process" in lines[0]
    assert f"pid {first.proc.pid}" in lines[0] and conv_id in lines[0]

    code, out, err = first.finish(timeout=240)
    assert code == 0, err
    assert "Traceback" not in err and error_lines(err) == []
    assert out.strip()
    [row] = listing(root)
    assert row["turns"] == 3 and row["error"] is None
    messages = exported(root, conv_id)
    assert messages[:4] == before and _user_prompts(messages)[2] == STORY
    assert lock.read_text() == ""  # released, pid erased
    assert opens_and_verifies(root, conv_id) == 3


# -- d. a corrupted segment -------------------------------------------------------------------
def test_a_corrupted_segment_is_named_in_one_line_and_list_export_still_work(copy, smollm2_dir):
    root, conv_id, before = copy
    segment = conversation_dir(root, conv_id) / "segments" / "turn-0001.safetensors"
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, in the middle of the tensor data
    segment.write_bytes(bytes(data))

    out = kvchat(
        root, "resume", conv_id, "--model", str(smollm2_dir), "--max-new-tokens", "2",
        "--prompt", "hi",
    )  # fmt: skip
    assert out.returncode == 1 and out.stdout == ""
    assert "Traceback" not in out.stderr
    [line] = error_lines(out.stderr)
    assert line.startswith("kvchat: error:") and "turn-0001.safetensors" in line
    assert "corrupted" in line and f"kvchat export {conv_id}" in line

    [row] = listing(root)
    assert row["id"] == conv_id and row["turns"] == 2
    assert exported(root, conv_id) == before
    md = kvchat(root, "export", conv_id, "--format", "md")
    assert md.returncode == 0 and all(p in md.stdout for p in FIRST_TURNS)
    assert len(segment.read_bytes()) == len(data)  # the damaged file is left for the user
