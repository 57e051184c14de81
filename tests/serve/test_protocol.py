"""Request validation and reply shapes, without a model."""

from __future__ import annotations

import json

import pytest

from kvchat.serve.protocol import RequestError, finish_reason, parse_chat_request


def parse(body) -> object:
    return parse_chat_request(json.dumps(body).encode())


def refused(raw: bytes | dict) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_chat_request(raw if isinstance(raw, bytes) else json.dumps(raw).encode())
    assert info.value.status == 400
    return info.value


def test_a_conversation_splits_into_system_history_and_the_new_turn():
    request = parse(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
                {"role": "user", "content": "Bye"},
            ],
            "max_tokens": 5,
            "temperature": 0,
            "seed": 3,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert request.system == "Be brief."
    assert request.history == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert request.user == "Bye"
    assert (request.max_tokens, request.temperature, request.seed) == (5, 0.0, 3)
    assert request.stop == ["\n"] and request.stream and request.include_usage


def test_defaults_are_kvchat_runs():
    request = parse({"messages": [{"role": "user", "content": "Hi"}]})
    assert request.max_tokens is None and request.temperature is None and request.top_p == 1.0
    assert request.stop == [] and not request.stream


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[1, 2]", "JSON object"),
        ({"messages": []}, "non-empty array"),
        ({"messages": "hi"}, "non-empty array"),
        ({"messages": [{"role": "user", "content": 5}]}, "must be a string"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role must be one of"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "last message must be a user"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
            "first message",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, "integer"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "at least 1"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "integer"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "number"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "between"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "above 0"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "true or false"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "at most 4"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "'n' must be 1"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "not supported"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "only text parts",
        ),
    ],
)
def test_bad_bodies_say_what_is_wrong(raw, words):
    assert words in refused(raw).message


def test_finish_reasons_use_openai_names():
    assert finish_reason("eos", False) == "stop"
    assert finish_reason("length", False) == "length"
    assert finish_reason("ceiling", False) == "length"
    assert finish_reason("cancelled", True) == "stop"
