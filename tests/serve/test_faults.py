"""Faults: a client leaving mid-stream, SIGTERM mid-reply, then a restart that continues."""

from __future__ import annotations

import json
import time

import pytest

from kvchat.commands.export import export_text
from kvchat.storage import ConversationStore
from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.slow
LONG = 400  # tokens a reply could run to if nothing stopped it (~20 s here)
STORY = [{"role": "user", "content": "Write a very long story about a dragon and a knight."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("faults") / "data").start()
    yield process
    process.stop()


def saved(data_dir, first_prompt: str) -> list[dict]:
    """Conversations in the store that start with this prompt, as exported JSON."""
    store = ConversationStore(data_dir)
    docs = [json.loads(export_text(store, row.id, "json")) for row in store.list() if row.turns]
    return [d for d in docs if d["messages"][0]["content"] == first_prompt]


def stream_some(server, messages, n_chunks: int):
    stream = server.client().chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=LONG, stream=True
    )
    text = ""
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        n_chunks -= 1
        if n_chunks <= 0:
            break
    return stream, text


def test_a_client_leaving_mid_stream_cancels_and_keeps_the_turn(server):
    stream, text = stream_some(server, STORY, n_chunks=4)
    stream.close()
    started = time.monotonic()
    reply = server.client().chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    # Served as soon as the cancelled reply stopped, not after LONG tokens.
    assert time.monotonic() - started < 10 and reply.choices[0].message.content
    [doc] = saved(server.data_dir, STORY[0]["content"])
    kept = doc["messages"][1]["content"]
    assert kept.startswith(text) and len(kept) < len(text) + 200


def test_sigterm_mid_reply_saves_the_turn_then_a_restart_continues_it(server, tmp_path):
    prompt = [{"role": "user", "content": "Tell me everything about the moon."}]
    stream, text = stream_some(server, prompt, n_chunks=4)
    server.proc.send_signal(15)
    for chunk in stream:  # the reply ends at the next token; the stream closes cleanly
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert server.proc.wait(timeout=60) in (0, -15)
    assert "stopped; every finished turn is saved" in server.read_log()
    [doc] = saved(server.data_dir, prompt[0]["content"])
    assert doc["messages"][1]["content"] == text

    again = ServerProcess(server.data_dir).start()
    try:
        follow_up = prompt + [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Shorter, please."},
        ]
        raw = again.client().chat.completions.with_raw_response.create(
            model="smollm2-135m", messages=follow_up, max_tokens=4
        )
        reply = raw.parse()
        assert raw.headers["x-kvchat-conversation"] == doc["id"]
        assert reply.kvchat["prefilled_tokens"] < reply.usage.prompt_tokens / 2
    finally:
        again.stop()
