"""/v1/responses with the official `openai` client against a real `kvchat serve`: text and
message input, instructions, streaming events, store, and previous_response_id continuing
the stored response's conversation exactly, across a restart too."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
PROMPTS = ["Name a colour.", "Another one.", "And a third?"]


def run_tokens(data_dir, *prompts: str, system: str | None = None) -> list[list[int]]:
    args = [sys.executable, "-m", "kvchat.cli", "run", "--json", "--no-save"]
    args += ["--max-new-tokens", str(MAX_TOKENS), "--data-dir", str(data_dir)]
    if system is not None:
        args += ["--system", system]
    for prompt in prompts:
        args += ["--prompt", prompt]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    return [json.loads(line)["tokens"] for line in out.stdout.splitlines()]


def test_previous_response_id_continues_exactly_across_a_restart(tmp_path):
    data = tmp_path / "data"
    expected = run_tokens(tmp_path / "fresh", *PROMPTS)
    server = ServerProcess(data).start()
    try:
        client = server.client()
        first = client.responses.create(
            model="smollm2-135m", input=PROMPTS[0], max_output_tokens=MAX_TOKENS
        )
        assert first.id.startswith("resp_") and first.status in ("completed", "incomplete")
        assert first.output_text and first.usage.input_tokens_details.cached_tokens == 0
        assert first.kvchat["tokens"] == expected[0]
        second = client.responses.create(
            model="smollm2-135m",
            input=[{"role": "user", "content": PROMPTS[1]}],
            previous_response_id=first.id,
            max_output_tokens=MAX_TOKENS,
        )
        assert second.kvchat["conversation"] == first.kvchat["conversation"]
        assert second.usage.input_tokens_details.cached_tokens > 0
        assert second.kvchat["prefilled_tokens"] < second.usage.input_tokens / 2
        assert second.kvchat["tokens"] == expected[1]
        assert second.previous_response_id == first.id
    finally:
        assert server.stop() in (0, -15)

    server = ServerProcess(data).start()
    try:
        client = server.client()
        stream = client.responses.create(
            model="smollm2-135m",
            input=PROMPTS[2],
            previous_response_id=second.id,
            max_output_tokens=MAX_TOKENS,
            stream=True,
        )
        events = list(stream)
        # A second answer to the first response: a branch of its conversation at turn 1.
        other = client.responses.create(
            model="smollm2-135m",
            input=PROMPTS[2],
            previous_response_id=first.id,
            max_output_tokens=MAX_TOKENS,
        )
    finally:
        server.stop()

    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed"
        if events[-1].response.status == "completed"
        else "response.incomplete",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text and final.kvchat["tokens"] == expected[2]
    assert final.kvchat["conversation"] == first.kvchat["conversation"]
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    assert other.kvchat["conversation"] != first.kvchat["conversation"]
    assert other.usage.input_tokens_details.cached_tokens > 0
    assert other.kvchat["tokens"] == run_tokens(tmp_path / "fresh", PROMPTS[0], PROMPTS[2])[1]


def test_instructions_store_false_and_refusals(tmp_path):
    server = ServerProcess(tmp_path / "data").start()
    try:
        client = server.client()
        told = client.responses.create(
            model="smollm2-135m",
            instructions="Answer in French.",
            input="Name a colour.",
            max_output_tokens=MAX_TOKENS,
            store=False,
        )
        assert told.id.startswith("resp_unsaved_") and told.store is False
        assert told.kvchat["conversation"] is None
        assert (
            told.kvchat["tokens"]
            == run_tokens(tmp_path / "fresh", "Name a colour.", system="Answer in French.")[0]
        )
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(
                model="smollm2-135m", input="Go on.", previous_response_id=told.id
            )
        assert refused.value.code == "previous_response_not_found"
        for bad in (
            {"tools": [{"type": "web_search"}]},
            {"text": {"format": {"type": "json_object"}}},
            {"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]},
        ):
            with pytest.raises(openai.BadRequestError):
                client.responses.create(model="smollm2-135m", **({"input": "Hi"} | bad))
        status, _, body = server.request(
            "POST", "/v1/responses", b'{"input": "x", "previous_response_id": "resp_nope_3"}'
        )
        assert status == 400 and json.loads(body)["error"]["param"] == "previous_response_id"
    finally:
        server.stop()
