"""`kvchat list / export / delete / gc / fork` as a user runs them, on real files.

Conversations are built with the store API directly (no model), so these tests are quick.
Real processes where a process is what is checked: that the store commands never import
torch, that they answer in half a second from a cold start, and the questions asked on a
terminal. The rest run in this process through click's runner (``kvchat_here``).
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvchat.storage import ConversationStore
from kvchat.storage.journal import JOURNAL_NAME, seal
from kvchat.storage.manifest import CHECKSUM_KEY
from tests.storage.test_store import new, save_turns, turn_tensors
from tests.test_cli import kvchat_here

HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x1b[41mred\x9b"

# Runs the real entry point, then reports which heavy modules it imported.
_RUN_MAIN = """
import atexit, sys
atexit.register(lambda: print(
    "HEAVY", [m for m in ("torch", "transformers") if m in sys.modules], file=sys.stderr))
from kvchat.cli import main
sys.argv = ["kvchat", *sys.argv[1:]]
main()
"""


def kvchat(*args: str) -> subprocess.CompletedProcess:
    """``kvchat ARGS`` in a new process, as a user starts it."""
    return subprocess.run(
        [sys.executable, "-c", _RUN_MAIN, *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )


@pytest.fixture
def data(tmp_path) -> Path:
    return tmp_path / "data"


def saved(data: Path, turns: int = 1, title: str | None = None) -> str:
    store = ConversationStore(data)
    conv = new(store)
    save_turns(conv, turns)
    conv.close()
    if title is not None:  # a sealed file from someone else: the title is in each record
        path = conv.path / JOURNAL_NAME
        lines = path.read_bytes().splitlines(keepends=True)
        record = json.loads(lines[-1])
        del record[CHECKSUM_KEY]
        record["title"] = title
        lines[-1] = seal(record)
        path.write_bytes(b"".join(lines))
    return conv.id


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_store_commands_never_import_torch_or_transformers(data):
    cid = saved(data, 2)
    for args in (
        ["list"],
        ["list", "--json"],
        ["export", cid],
        ["export", cid, "--format", "json"],
        ["gc"],
        ["fork", cid, "--turn", "1"],
        ["delete", cid],
    ):
        out = kvchat(*args, "--data-dir", str(data))
        assert out.returncode == 0, out.stderr
        assert "HEAVY []" in out.stderr, (args, out.stderr)


def test_list_export_and_delete_answer_in_half_a_second_among_100_conversations(data):
    store = ConversationStore(data)
    for i in range(100):
        conv = new(store)
        conv.append_turn(
            messages=[{"role": "user", "content": f"question {i}"}],
            token_ids=[1, 2, 3],
            tensors=turn_tensors(i, n=2),
        )
        conv.close()
    best = float("inf")
    for _ in range(3):  # best of three: the machine is shared
        started = time.perf_counter()
        out = kvchat("list", "--data-dir", str(data))
        best = min(best, time.perf_counter() - started)
        assert out.returncode == 0 and len(out.stdout.splitlines()) == 101, out.stderr
    assert best < 0.5, f"kvchat list took {best:.2f} s for 100 conversations"

    ids = sorted(p.name for p in (data / "conversations").iterdir())
    for args in (["export", ids[0]], ["export", ids[1], "--format", "json"], ["delete", ids[2]]):
        started = time.perf_counter()
        out = kvchat(*args, "--data-dir", str(data))
        took = time.perf_counter() - started
        assert out.returncode == 0, out.stderr
        assert took < 0.5 or _best_of_two(args[0], ids, data) < 0.5, (args, took)
    assert not (data / "conversations" / ids[2]).exists()


def _best_of_two(command: str, ids: list[str], data) -> float:
    """A second try on another conversation (the machine is shared)."""
    args = [command, ids[10]] if command == "export" else [command, ids[11]]
    started = time.perf_counter()
    kvchat(*args, "--data-dir", str(data))
    return time.perf_counter() - started


@pytest.mark.parametrize(
    "args",
    [["list"], ["list", "--json"], ["export", "x"], ["delete", "x"], ["delete", "x", "--yes"]]
    + [["gc"], ["gc", "--json"]],
)
def test_a_data_dir_that_is_a_file_is_one_line(tmp_path, args):
    not_a_folder = tmp_path / "passwd"
    not_a_folder.write_text("root:x:0:0::/root:/bin/sh\n")
    for data_dir in (str(not_a_folder), "/etc/passwd"):
        out = kvchat_here(*args, "--data-dir", data_dir)
        assert out.returncode == 1
        assert "Traceback" not in out.stderr + out.stdout
        (line,) = out.stderr.splitlines()
        assert line.startswith("kvchat: error: ") and "is not a folder" in line


def test_list_and_export_never_print_terminal_escapes(data):
    cid = saved(data, title=HOSTILE)
    exports = (["export", cid], ["export", cid, "--format", "json"])
    for args in (["list"], ["list", "--json"], *exports):
        out = kvchat_here(*args, "--data-dir", str(data))
        assert out.returncode == 0, out.stderr
        assert "\x1b" not in out.stdout and "\x07" not in out.stdout and "\x9b" not in out.stdout
    listed = kvchat_here("list", "--data-dir", str(data)).stdout
    assert "\\x1b]0;pwned\\x07" in listed  # shown as text, so the user sees what is there
    doc = json.loads(kvchat_here("list", "--json", "--data-dir", str(data)).stdout)
    assert doc["conversations"][0]["title"] == HOSTILE  # exact in JSON, only escaped


def test_list_shows_a_linked_conversation_and_delete_removes_only_the_link(data, tmp_path):
    cid = saved(data)
    outside = tmp_path / "outside"
    (data / "conversations" / cid).rename(outside)
    os.symlink(outside, data / "conversations" / cid)
    listed = kvchat_here("list", "--data-dir", str(data))
    assert cid in listed.stdout and "symbolic link" in listed.stdout
    out = kvchat_here("export", cid, "--data-dir", str(data))
    assert out.returncode == 1 and "symbolic link" in out.stderr
    out = kvchat_here("delete", cid, "--data-dir", str(data))
    assert out.returncode == 0 and "removed the link" in out.stdout
    assert (outside / "manifest.json").exists()
    assert not os.path.lexists(data / "conversations" / cid)


def test_list_counts_spill_and_gc_frees_what_dead_processes_left(data):
    saved(data)
    stale = data / "spill" / f"{dead_pid()}-abcd1234"
    stale.mkdir(parents=True)
    (stale / "L0.bin").write_bytes(b"\0" * 3000)
    mine = data / "spill" / f"{os.getpid()}-00000000"  # a live session: kept
    mine.mkdir()
    (mine / "L3.bin").write_bytes(b"\0" * 1000)

    listed = kvchat_here("list", "--data-dir", str(data))
    assert "spill files: 3.9 KiB" in listed.stdout and "kvchat gc" in listed.stdout
    spill = json.loads(kvchat_here("list", "--json", "--data-dir", str(data)).stdout)["spill"]
    assert spill["bytes"] == 4000 and spill["stale_bytes"] == 3000

    freed = json.loads(kvchat_here("gc", "--json", "--data-dir", str(data)).stdout)
    assert freed["spill_freed_bytes"] == 3000 and freed["spill_in_use_bytes"] == 1000
    assert not stale.exists() and mine.exists()
    assert kvchat_here("gc", "--data-dir", str(data)).stdout.startswith("nothing to free")
    listed = kvchat_here("list", "--data-dir", str(data)).stdout
    assert "spill files: 1000 B" in listed and "kvchat gc" not in listed


def test_gc_removes_leftovers_of_an_interrupted_delete(data):
    saved(data)
    leftover = data / "conversations" / ".deleting-20260101-000000-abcd-1234"
    leftover.mkdir()
    (leftover / "manifest.json").write_text("{}" * 50)
    out = kvchat_here("gc", "--data-dir", str(data))
    assert out.returncode == 0 and "freed 100 B" in out.stdout and not leftover.exists()


# -- delete: prefixes and confirmation --------------------------------------------------------


def ids_in(data: Path) -> list[str]:
    return [r.id for r in ConversationStore(data).list()]


def test_delete_by_prefix_needs_yes(data):
    cid = saved(data)
    out = kvchat_here("delete", cid[:10], "--data-dir", str(data))
    assert out.returncode == 1
    (line,) = out.stderr.splitlines()
    assert cid in line and "--yes" in line
    assert ids_in(data) == [cid]
    out = kvchat_here("delete", cid[:10], "--yes", "--data-dir", str(data))
    assert out.returncode == 0 and out.stdout.strip() == f"deleted {cid}"
    assert ids_in(data) == []


def test_delete_of_a_full_id_from_a_script_does_not_ask(data):
    cid = saved(data)
    out = kvchat_here("delete", cid, "--data-dir", str(data))
    assert out.returncode == 0 and out.stdout.strip() == f"deleted {cid}"


def on_terminal(args: list[str], answer: str) -> tuple[int, str]:
    """Run kvchat with a pseudo-terminal as stdin/stdout/stderr; type ``answer``."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN_MAIN, *args],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        close_fds=True,
    )
    os.close(follower)
    os.write(leader, answer.encode())
    seen = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    os.close(leader)
    return proc.wait(timeout=30), seen.decode(errors="replace")


@pytest.mark.parametrize("answer, deleted", [("n\n", False), ("\n", False), ("y\n", True)])
def test_delete_on_a_terminal_asks_first(data, answer, deleted):
    cid = saved(data, 2, title="weekend plans")
    code, shown = on_terminal(["delete", cid, "--data-dir", str(data)], answer)
    assert f"delete conversation {cid} (weekend plans; 2 turn(s)" in shown
    assert "[y/N]" in shown and "Traceback" not in shown
    assert (code == 0) is deleted and (ids_in(data) == []) is deleted
    assert ("nothing deleted" in shown) is not deleted


def test_delete_on_a_terminal_with_yes_does_not_ask(data):
    cid = saved(data)
    code, shown = on_terminal(["delete", cid, "--yes", "--data-dir", str(data)], "")
    assert code == 0 and "[y/N]" not in shown and ids_in(data) == []


def test_delete_by_prefix_on_a_terminal_still_needs_yes(data):
    cid = saved(data)
    code, shown = on_terminal(["delete", cid[:10], "--data-dir", str(data)], "y\n")
    assert code == 1 and "--yes" in shown and ids_in(data) == [cid]


def test_fork_prints_the_new_id_and_list_shows_where_it_came_from(data):
    cid = saved(data, 3)
    out = kvchat_here("fork", cid, "--turn", "2", "--json", "--data-dir", str(data))
    assert out.returncode == 0, out.stderr
    fork = json.loads(out.stdout)["conversation"]
    plain = kvchat_here("fork", cid, "--data-dir", str(data))
    assert plain.returncode == 0, plain.stderr
    whole = plain.stdout.strip()
    rows = {
        r["id"]: r
        for r in json.loads(kvchat_here("list", "--json", "--data-dir", str(data)).stdout)[
            "conversations"
        ]
    }
    assert rows[fork]["forked_from"] == {"id": cid, "turn": 2} and rows[fork]["turns"] == 2
    assert rows[whole]["forked_from"] == {"id": cid, "turn": 3}
    assert rows[cid]["forked_from"] is None and rows[cid]["shared_bytes"] > 0
    table = kvchat_here("list", "--data-dir", str(data)).stdout
    line = next(x for x in table.splitlines() if x.startswith(fork))
    assert f"(fork of {cid} at turn 2)" in line
    assert "* shares saved turns with a fork" in table
    assert kvchat_here("delete", cid, "--data-dir", str(data)).returncode == 0
    exported = kvchat_here("export", fork, "--data-dir", str(data))
    assert exported.returncode == 0 and "question 2" in exported.stdout
    assert "question 3" not in exported.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--turn", "9"], "between 0 and 2"),
        (["--turn", "-1"], "-1 is not in the range"),
    ],
)
def test_fork_at_a_turn_that_does_not_exist_is_one_line_and_makes_nothing(data, args, message):
    cid = saved(data, 2)
    out = kvchat_here("fork", cid, *args, "--data-dir", str(data))
    assert out.returncode != 0
    lines = out.stderr.splitlines()
    assert message in lines[-1] and "Traceback" not in out.stderr
    listed = kvchat_here("list", "--json", "--data-dir", str(data))
    rows = json.loads(listed.stdout)["conversations"]
    assert [r["id"] for r in rows] == [cid]


def test_fork_of_an_unknown_id_says_how_to_find_one(data):
    saved(data, 1)
    out = kvchat_here("fork", "nope", "--data-dir", str(data))
    assert out.returncode == 1 and "kvchat list" in out.stderr.splitlines()[-1]
