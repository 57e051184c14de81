"""OpenAI chat-completions shapes: validating a request body, building replies and errors.

Plain Python values only (no engine, no HTTP), so every rule here is testable on its own.
Fields kvchat cannot honour exactly (``n`` > 1, tools) are refused with a message rather
than silently ignored; fields that change nothing for a local model (``user``,
``frequency_penalty`` at 0, ...) are accepted and ignored.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_TOKENS = 256  # the same default as `kvchat run --max-new-tokens`
MAX_STOP_SEQUENCES = 4
ROLES = ("system", "user", "assistant")
REFUSED_FIELDS = ("tools", "functions", "tool_choice", "function_call", "logprobs", "audio")


class RequestError(Exception):
    """A request the server answers with an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return error_body(self.message, kind=self.kind, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class ChatRequest:
    """A validated request: the conversation so far, the new user turn, sampling."""

    model: str
    system: str | None
    history: list[dict[str, str]]  # user/assistant messages before the new user turn
    user: str
    max_tokens: int | None = None  # None: the server's default, capped by the context
    temperature: float | None = None  # None or 0: greedy, like `kvchat run`
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    save: bool = True  # False (the Responses API's store: false): answered, never saved

    @property
    def messages(self) -> list[dict[str, str]]:
        """Every message, the system prompt first, as a chat template takes them."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + self.history + [{"role": "user", "content": self.user}]


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; RequestError when it is not UTF-8 JSON or not one."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError("the request body is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise RequestError(
            f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} column "
            f"{exc.colno})"
        ) from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def parse_chat_request(raw: bytes) -> ChatRequest:
    """Validate a ``POST /v1/chat/completions`` body; RequestError says what is wrong."""
    body = json_object(raw)
    for name in REFUSED_FIELDS:
        if body.get(name) not in (None, False, [], {}):
            raise RequestError(f"'{name}' is not supported by kvchat serve", param=name)
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise RequestError("'n' must be 1: kvchat serve generates one choice", param="n")

    model = body.get("model", "")
    if not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    system, history, user = _split_messages(body.get("messages"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    return ChatRequest(
        model=model,
        system=system,
        history=history,
        user=user,
        max_tokens=optional_int(max_tokens, "max_tokens", minimum=1),
        temperature=optional_number(body.get("temperature"), "temperature", 0.0, 2.0),
        top_p=top_p_value(body.get("top_p")),
        seed=optional_int(body.get("seed"), "seed"),
        stop=_stop(body.get("stop")),
        stream=optional_bool(body.get("stream"), "stream"),
        include_usage=optional_bool(stream_options.get("include_usage"), "include_usage"),
    )


def _split_messages(messages: Any) -> tuple[str | None, list[dict[str, str]], str]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array", param="messages")
    cleaned = [_message(m, i) for i, m in enumerate(messages)]
    system = None
    if cleaned[0]["role"] == "system":
        system = cleaned.pop(0)["content"]
    for i, m in enumerate(cleaned):
        if m["role"] == "system":
            raise RequestError(
                "only the first message may be a system message", param=f"messages[{i}]"
            )
    if not cleaned or cleaned[-1]["role"] != "user":
        raise RequestError("the last message must be a user message", param="messages")
    return system, cleaned[:-1], cleaned[-1]["content"]


def _message(message: Any, index: int) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{param} must be an object with 'role' and 'content'", param=param)
    role = message.get("role")
    if role == "developer":  # newer clients' name for the system prompt
        role = "system"
    if role not in ROLES:
        raise RequestError(
            f"{param}.role must be one of {', '.join(ROLES)}, not {role!r}", param=param
        )
    return {"role": role, "content": _content(message.get("content"), param)}


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(f"{param}.content: only text parts are supported", param=param)
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestError(f"{param}.content: a text part needs 'text'", param=param)
            parts.append(text)
        return "".join(parts)
    raise RequestError(f"{param}.content must be a string", param=param)


def optional_int(value: Any, name: str, minimum: int | None = None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{name}' must be an integer", param=name)
    if minimum is not None and value < minimum:
        raise RequestError(f"'{name}' must be at least {minimum}, not {value}", param=name)
    return value


def optional_number(value: Any, name: str, low: float, high: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"'{name}' must be a number", param=name)
    if not low <= value <= high:
        raise RequestError(f"'{name}' must be between {low:g} and {high:g}", param=name)
    return float(value)


def top_p_value(value: Any) -> float:
    top_p = optional_number(value, "top_p", 0.0, 1.0)
    if top_p is None:
        return 1.0
    if top_p == 0.0:
        raise RequestError("'top_p' must be above 0", param="top_p")
    return top_p


def optional_bool(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be true or false", param=name)
    return value


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("'stop' must be a string or an array of strings", param="stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise RequestError(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences", param="stop")
    return stops


# -- replies ---------------------------------------------------------------------------


def new_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def finish_reason(engine_reason: str, stopped_by_sequence: bool) -> str:
    """OpenAI's names: the engine's "eos" is "stop"; a ceiling reached mid-reply is "length"."""
    if stopped_by_sequence or engine_reason in ("eos", "stop", "cancelled"):
        return "stop"
    return "length"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens whose saved state was reused."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    *,
    completion_id: str,
    model: str,
    content: str,
    finish: str,
    usage_: dict[str, Any],
    extension: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish,
                "logprobs": None,
            }
        ],
        "usage": usage_,
        "kvchat": extension,
    }


def chunk_body(
    *,
    completion_id: str,
    model: str,
    delta: dict[str, str],
    finish: str | None = None,
    extension: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }
    if extension is not None:
        body["kvchat"] = extension
    return body


def usage_chunk_body(*, completion_id: str, model: str, usage_: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage_,
    }
