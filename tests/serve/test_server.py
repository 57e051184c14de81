"""The official `openai` client against a real `kvchat serve` process (one per module)."""

from __future__ import annotations

import json

import openai
import pytest

from kvchat.commands.export import export_text
from kvchat.storage import ConversationStore
from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.slow
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("serve") / "data").start()
    yield process
    process.stop()


def ask(client, messages, **kw):
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2-135m", messages=messages, max_tokens=MAX_TOKENS, **kw
    )
    return raw.headers, raw.parse()


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list()] == ["smollm2-135m"]
    status, _, body = server.request("GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_a_reply_then_its_continuation_from_the_same_conversation(server):
    client = server.client()
    first = [{"role": "user", "content": "Name a colour."}]
    headers, reply = ask(client, first)
    conversation = headers["x-kvchat-conversation"]
    text = reply.choices[0].message.content
    assert text and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.kvchat["conversation"] == conversation and reply.kvchat["saved"]
    assert reply.usage.completion_tokens == len(reply.kvchat["tokens"]) <= MAX_TOKENS

    second = first + [
        {"role": "assistant", "content": text},
        {"role": "user", "content": "Another one."},
    ]
    headers, reply2 = ask(client, second)
    assert headers["x-kvchat-conversation"] == conversation
    # Only the new turn was fed: the history was already in the conversation's state.
    assert reply2.kvchat["prefilled_tokens"] < reply2.usage.prompt_tokens / 2

    listed = {row.id: row for row in ConversationStore(server.data_dir).list()}
    assert listed[conversation].turns == 2
    exported = json.loads(export_text(ConversationStore(server.data_dir), conversation, "json"))
    assert [m["content"] for m in exported["messages"]] == [
        "Name a colour.",
        text,
        "Another one.",
        reply2.choices[0].message.content,
    ]


def test_streaming_gives_the_same_reply_as_not_streaming(server):
    client = server.client()
    messages = [{"role": "user", "content": "Say hello."}]
    _, plain = ask(client, messages)
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1
    assert finishing[0].kvchat["tokens"] == plain.kvchat["tokens"]  # greedy, same prompt
    assert finishing[0].kvchat["conversation"] != plain.kvchat["conversation"]  # a new one
    assert chunks[-1].usage.completion_tokens == len(plain.kvchat["tokens"])


def test_a_stop_sequence_ends_the_reply_before_it(server):
    _, plain = ask(server.client(), [{"role": "user", "content": "Count: 1, 2, 3,"}])
    text = plain.choices[0].message.content
    stop = text[len(text) // 2 :][:2]
    if not stop.strip():
        pytest.skip("the reply has no usable stop sequence")
    _, cut = ask(server.client(), [{"role": "user", "content": "Count: 1, 2, 3,"}], stop=[stop])
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_a_history_no_conversation_holds_starts_a_new_saved_conversation(server):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "An answer this server never gave."},
        {"role": "user", "content": "Go on."},
    ]
    headers, reply = ask(server.client(), messages)
    assert reply.kvchat["saved"] is True and reply.choices[0].message.content
    conversation = reply.kvchat["conversation"]
    assert conversation
    # The next turn continues from its files: only the new message is fed.
    follow = [*messages, {"role": "assistant", "content": reply.choices[0].message.content},
              {"role": "user", "content": "Thanks."}]  # fmt: skip
    _, again = ask(server.client(), follow)
    assert again.kvchat["conversation"] == conversation
    assert again.kvchat["prefilled_tokens"] < again.usage.prompt_tokens / 2


@pytest.mark.parametrize(
    "body, words",
    [
        (b"{not json", "not valid JSON"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "must be a string"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', "integer"),
        (b'{"messages": "x"}', "non-empty array"),
    ],
)
def test_bad_bodies_get_400_with_a_message(server, body, words):
    status, _, raw = server.request(
        "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    error = json.loads(raw)["error"]
    assert status == 400 and words in error["message"] and error["type"]


def test_the_client_sees_bad_requests_as_bad_request_errors(server):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        ask(server.client(), [{"role": "user", "content": "x"}], temperature="hot")


def test_an_oversized_body_gets_400(server):
    body = json.dumps({"messages": [{"role": "user", "content": "x" * (5 << 20)}]}).encode()
    status, _, raw = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and "over" in json.loads(raw)["error"]["message"]


def test_over_the_context_length_is_refused_with_the_numbers(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=100_000,
        )
    error = info.value.body
    assert error["code"] == "context_length_exceeded"
    assert "8192" in error["message"] and "100000 in the completion" in error["message"]


def test_unknown_endpoints_and_methods_answer_json(server):
    status, _, raw = server.request("GET", "/v1/nothing")
    assert status == 404 and json.loads(raw)["error"]["message"]
    status, _, raw = server.request("GET", "/v1/chat/completions")
    assert status == 405 and json.loads(raw)["error"]["message"]


def test_no_response_names_a_path_outside_the_data_dir(server):
    _, _, raw = server.request("GET", "/v1/models")
    assert b"/root" not in raw and str(server.data_dir.parent).encode() not in raw
