"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat turn the worker serves.

A request becomes the same ``ChatRequest`` a chat completion does: ``instructions`` is the
system prompt, ``input`` (a string, or message items of text) the messages, and
``previous_response_id`` the conversation as it stood after that response. A stored
response's id names its conversation and turn (``resp_<conversation>_<turn>``), so continuing
from it is resuming that saved state: the worker continues the conversation when the turn
is its last, or forks it there (a second answer to the same response), and reads only the
new input either way. Nothing else is kept: the store is the state. ``store: false``
answers from the text and saves nothing; such a response cannot be continued.

Fields kvchat cannot honour (tools, reasoning, structured output, background runs) are
refused with OpenAI-shaped 400s; fields that change nothing for a local model (``user``,
``metadata``, ``truncation: disabled``...) are accepted and ignored.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from kvchat.serve.protocol import (
    ROLES,
    ChatRequest,
    RequestError,
    json_object,
    optional_bool,
    optional_int,
    optional_number,
    top_p_value,
)

RESPONSE_ID = re.compile(r"^resp_([0-9A-Za-z][0-9A-Za-z_-]*)_(\d+)$")
REFUSED = ("tools", "tool_choice", "reasoning", "background", "prompt", "conversation")
TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class ResponsesRequest:
    chat: ChatRequest
    store: bool
    instructions: str | None
    previous_response_id: str | None


def response_id(conversation: str | None, turn: int | None) -> str:
    """``resp_<conversation>_<turn>`` for a stored turn; a random id for one not stored."""
    if conversation is None or turn is None:
        return "resp_unsaved_" + secrets.token_hex(12)
    return f"resp_{conversation}_{turn}"


def parse_response_id(value: str) -> tuple[str, int]:
    """The conversation and turn a response id names; RequestError if it names none."""
    found = RESPONSE_ID.match(value)
    if found is None or value.startswith("resp_unsaved_"):
        raise RequestError(
            f"Previous response with id '{value}' not found (responses made with "
            "store: false cannot be continued).",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return found.group(1), int(found.group(2))


def parse_responses_request(raw: bytes, history_of: Any) -> ResponsesRequest:
    """Validate a ``POST /v1/responses`` body. ``history_of(conversation, turn)`` returns
    ``(system, messages)`` of a stored response's conversation as it stood after that turn,
    or raises RequestError."""
    body = json_object(raw)
    for name in REFUSED:
        if body.get(name) not in (None, False, [], {}, "auto", "none"):
            raise RequestError(f"'{name}' is not supported by kvchat serve", param=name)
    text_format = ((body.get("text") or {}).get("format") or {}).get("type", "text")
    if text_format != "text":
        raise RequestError(
            "'text.format' must be text: kvchat serve has no structured output",
            param="text.format",
        )
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("'instructions' must be a string", param="instructions")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise RequestError("'store' must be true or false", param="store")
    previous = body.get("previous_response_id")
    system, history = instructions, []
    if previous is not None:
        if not isinstance(previous, str):
            raise RequestError(
                "'previous_response_id' must be a string", param="previous_response_id"
            )
        conversation, turn = parse_response_id(previous)
        saved_system, history = history_of(conversation, turn)
        system = instructions if instructions is not None else saved_system
    items = _input_messages(body.get("input"))
    for i, m in enumerate(items):
        if m["role"] == "system":
            if i or history:
                raise RequestError(
                    "a system or developer message may only come first; use 'instructions'",
                    param="input",
                )
            system = m["content"] if system is None else system + "\n\n" + m["content"]
    items = [m for m in items if m["role"] != "system"]
    messages = history + items
    if not messages or messages[-1]["role"] != "user":
        raise RequestError("the input must end with a user message", param="input")
    chat = ChatRequest(
        model=body.get("model") if isinstance(body.get("model"), str) else "",
        system=system,
        history=messages[:-1],
        user=messages[-1]["content"],
        max_tokens=optional_int(body.get("max_output_tokens"), "max_output_tokens", minimum=1),
        temperature=optional_number(body.get("temperature"), "temperature", 0.0, 2.0),
        top_p=top_p_value(body.get("top_p")),
        stream=optional_bool(body.get("stream"), "stream"),
        include_usage=True,
        save=store,
    )
    return ResponsesRequest(chat, store, instructions, previous)


def _input_messages(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        if not value:
            raise RequestError("'input' must not be empty", param="input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError("'input' must be a string or a non-empty array", param="input")
    out = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise RequestError(
                f"{param}: only message items are supported, not {kind!r}", param=param
            )
        role = "system" if item.get("role") == "developer" else item.get("role")
        if role not in ROLES:
            raise RequestError(f"{param}.role must be user, assistant, system or developer")
        out.append({"role": role, "content": _text(item.get("content"), param)})
    return out


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
                raise RequestError(f"{param}.content: only text parts are supported", param=param)
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{param}.content: a text part needs 'text'", param=param)
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{param}.content must be a string or an array of parts", param=param)


# -- replies ---------------------------------------------------------------------------------


def response_body(
    *,
    rid: str,
    model: str,
    request: ResponsesRequest,
    text: str,
    status: str = "completed",
    incomplete: str | None = None,
    usage: dict[str, Any] | None = None,
    message_id: str | None = None,
    extension: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``response`` object; ``status`` in_progress (no output yet), completed, incomplete."""
    output = []
    if status != "in_progress":
        output = [message_item(message_id or "msg_" + rid[5:], text, "completed")]
    body: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "instructions": request.instructions,
        "previous_response_id": request.previous_response_id,
        "store": request.store,
        "temperature": request.chat.temperature if request.chat.temperature is not None else 0,
        "top_p": request.chat.top_p,
        "max_output_tokens": request.chat.max_tokens,
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": {},
        "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "usage": usage,
    }
    if extension is not None:
        body["kvchat"] = extension
    return body


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }
