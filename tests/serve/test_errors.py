"""Errors a client can meet: a ceiling that cannot hold the prompt, an unreadable saved
conversation. OpenAI-style bodies with the numbers; no path outside the data dir."""

from __future__ import annotations

import openai
import pytest

from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The standard cache under 4 MB holds ~85 SmolLM2 tokens (fp32): short turns fit, long ones not.
    data = tmp_path_factory.mktemp("errors") / "data"
    process = ServerProcess(data, "--cache", "standard", "--max-mem", "4MB").start()
    yield process
    process.stop()


def ask(server, messages, max_tokens=2):
    return server.client(max_retries=0).chat.completions.with_raw_response.create(
        model="smollm2-135m", messages=messages, max_tokens=max_tokens
    )


def test_a_prompt_the_ceiling_cannot_hold_is_refused_with_the_numbers(server):
    long = [{"role": "user", "content": "Tell me about rivers. " * 40}]
    with pytest.raises(openai.BadRequestError) as info:
        ask(server, long)
    error = info.value.body
    assert error["code"] == "memory_ceiling_exceeded"
    assert "tokens" in error["message"] and "--max-mem" in error["message"]
    # Nothing was truncated or saved, and the server goes on serving.
    assert ask(server, [{"role": "user", "content": "Hi"}]).parse().choices[0].message.content


def test_an_unreadable_conversation_is_reported_without_host_paths(server):
    first = [{"role": "user", "content": "Hi"}]
    raw = ask(server, first)
    conversation = raw.headers["x-kvchat-conversation"]
    ask(server, [{"role": "user", "content": "Hello"}])  # another one: the first goes to disk
    for segment in (server.data_dir / "conversations" / conversation / "segments").iterdir():
        segment.write_bytes(b"\0" * segment.stat().st_size)
    follow_up = first + [
        {"role": "assistant", "content": raw.parse().choices[0].message.content},
        {"role": "user", "content": "Again"},
    ]
    with pytest.raises(openai.APIStatusError) as info:
        ask(server, follow_up)
    message = info.value.body["message"]
    assert info.value.status_code == 500 and message
    assert str(server.data_dir) not in message and "/tmp" not in message and "/root" not in message
