"""The per-conversation lock, exercised with real second processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvchat.commands.export import export_text
from kvchat.storage import ConversationLockedError, ConversationStore

REPO = Path(__file__).resolve().parents[2]

HOLDER = """
    import sys
    from kvchat.storage import ConversationStore
    conv = ConversationStore(sys.argv[1]).open(sys.argv[2])
    print("OPEN", flush=True)
    sys.stdin.readline()  # hold the lock until the parent says so (or kills us)
    conv.close()
"""

CONTENDER = """
    import sys
    from kvchat.storage import ConversationStore, ConversationLockedError
    store = ConversationStore(sys.argv[1])
    for attempt in (lambda: store.open(sys.argv[2]), lambda: store.delete(sys.argv[2])):
        try:
            attempt()
            print("UNEXPECTEDLY SUCCEEDED")
        except ConversationLockedError as e:
            print(e)
"""


def python(code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        text=True,
        **kw,
    )


@pytest.fixture
def store_and_id(tmp_path):
    store = ConversationStore(tmp_path)
    conv = store.create(model_name="m", fingerprint="fp", dtype="float32", settings={})
    conv.append_turn(messages=[{"role": "user", "content": "hi"}], token_ids=[1], tensors={})
    conv.close()
    return store, conv.id


def test_other_process_holding_the_lock_blocks_open_and_delete(store_and_id):
    store, cid = store_and_id
    with python(
        HOLDER, str(store.root), cid, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as holder:
        try:
            assert holder.stdout.readline().strip() == "OPEN"
            with pytest.raises(ConversationLockedError) as err:
                store.open(cid)
            assert str(err.value) == (
                f"conversation {cid} is open in another kvchat process (pid {holder.pid}); "
                "close it there first"
            )
            with pytest.raises(ConversationLockedError):
                store.delete(cid)
            assert [r.id for r in store.list()] == [cid]  # listing and export are not blocked
            assert "hi" in export_text(store, cid, "md")
        finally:
            holder.kill()  # as a crash would: the kernel drops the dead holder's flock
            holder.wait(timeout=30)
    with store.open(cid) as conv:
        assert conv.manifest.token_ids == [1]
    store.delete(cid)
    assert store.list() == []


def test_this_process_holding_the_lock_blocks_another(store_and_id):
    store, cid = store_and_id
    with store.open(cid):
        with python(CONTENDER, str(store.root), cid, stdout=subprocess.PIPE) as contender:
            out, _ = contender.communicate(timeout=60)
    assert contender.returncode == 0
    lines = out.strip().splitlines()
    expected = (
        f"conversation {cid} is open in another kvchat process (pid {os.getpid()}); "
        "close it there first"
    )
    assert lines == [expected, expected]
    store.open(cid).close()  # released on close
