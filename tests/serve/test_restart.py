"""A 3-turn conversation with a server restart between turns 2 and 3 gives exactly the
tokens `kvchat run` gives for the same prompts, and turn 3 resumes from the files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
PROMPTS = ["What is a cat?", "And a dog?", "Which one is bigger?"]


def kvchat_run_tokens(data_dir) -> list[list[int]]:
    args = [sys.executable, "-m", "kvchat.cli", "run", "--json", "--no-save"]
    args += ["--max-new-tokens", str(MAX_TOKENS), "--data-dir", str(data_dir)]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    return [json.loads(line)["tokens"] for line in out.stdout.splitlines()]


def turn(server, messages):
    raw = server.client().chat.completions.with_raw_response.create(
        model="smollm2-135m", messages=messages, max_tokens=MAX_TOKENS
    )
    return raw.headers["x-kvchat-conversation"], raw.parse()


def test_restart_between_turns_continues_exactly(tmp_path):
    data = tmp_path / "data"
    messages: list[dict[str, str]] = []
    replies = []
    server = ServerProcess(data).start()
    try:
        for prompt in PROMPTS[:2]:
            messages.append({"role": "user", "content": prompt})
            conversation, reply = turn(server, messages)
            replies.append(reply)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    finally:
        assert server.stop() in (0, -15)
    assert "stopped; every finished turn is saved" in server.read_log()

    server = ServerProcess(data).start()
    try:
        messages.append({"role": "user", "content": PROMPTS[2]})
        again, reply = turn(server, messages)
        replies.append(reply)
    finally:
        server.stop()

    assert again == conversation
    # Resumed from the files: only the new turn was fed, not the whole history.
    assert reply.kvchat["prefilled_tokens"] < reply.usage.prompt_tokens / 3
    assert [r.kvchat["tokens"] for r in replies] == kvchat_run_tokens(tmp_path / "run-data")

    listed = subprocess.run(
        [sys.executable, "-m", "kvchat.cli", "list", "--json", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {row["id"]: row for row in json.loads(listed.stdout)["conversations"]}
    assert rows[conversation]["turns"] == 3 and not rows[conversation]["error"]
