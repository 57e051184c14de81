"""Server-sent events for a streamed chat completion (OpenAI's chunk shapes) and a streamed
response (the Responses API's typed events)."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvchat.serve import protocol, responses
from kvchat.serve.responses import ResponsesRequest
from kvchat.serve.worker import Job, TurnReply

DONE = "data: [DONE]\n\n"


def event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def stream_completion(
    *,
    job: Job,
    first: tuple[str, Any],
    events: asyncio.Queue,
    completion_id: str,
    model: str,
    extension: Callable[[TurnReply], dict[str, Any]],
) -> AsyncIterator[str]:
    """Role chunk, one chunk per text delta, the finishing chunk, usage, ``[DONE]``.

    ``extension(reply)`` builds the ``kvchat`` field. Leaving early (the client went away,
    so the server stops iterating) cancels the generation at its next token; the turn is
    still saved, as when Ctrl-C stops ``kvchat run``.
    """
    ids = {"completion_id": completion_id, "model": model}
    try:
        yield event(protocol.chunk_body(**ids, delta={"role": "assistant", "content": ""}))
        kind, payload = first
        while True:
            if kind == "text":
                yield event(protocol.chunk_body(**ids, delta={"content": payload}))
            elif kind == "done":
                finish = protocol.finish_reason(payload.finish_reason, payload.stopped_by_sequence)
                yield event(
                    protocol.chunk_body(
                        **ids, delta={}, finish=finish, extension=extension(payload)
                    )
                )
                if job.request.include_usage:
                    usage = protocol.usage(
                        payload.prompt_tokens, len(payload.tokens), payload.cached_tokens
                    )
                    yield event(protocol.usage_chunk_body(**ids, usage_=usage))
                yield DONE
                return
            elif kind == "error":
                yield event(payload.body())
                yield DONE
                return
            kind, payload = await events.get()
    finally:
        job.cancel.set()  # a no-op once the turn is done


def finished_response(
    reply: TurnReply,
    asked: ResponsesRequest,
    model: str,
    extension: Callable[[TurnReply], dict[str, Any]],
) -> dict[str, Any]:
    """The ``response`` object of a finished turn."""
    rid = responses.response_id(reply.conversation if asked.store else None, reply.turn)
    cut = reply.finish_reason in ("length", "ceiling") and not reply.stopped_by_sequence
    return responses.response_body(
        rid=rid,
        model=model,
        request=asked,
        text=reply.content,
        status="incomplete" if cut else "completed",
        incomplete="max_output_tokens" if cut else None,
        usage=responses.usage(reply.prompt_tokens, len(reply.tokens), reply.cached_tokens),
        extension=extension(reply),
    )


async def stream_response(
    *,
    job: Job,
    first: tuple[str, Any],
    events: asyncio.Queue,
    asked: ResponsesRequest,
    model: str,
    extension: Callable[[TurnReply], dict[str, Any]],
) -> AsyncIterator[str]:
    """``response.created``, the message item and its text part opened, one
    ``response.output_text.delta`` per piece, then everything closed and
    ``response.completed`` (or ``response.incomplete``) with the final response, whose id
    names the saved turn. Leaving early cancels the generation, as for chat completions."""
    pending = "resp_pending_" + secrets.token_hex(8)
    item_id = "msg_" + secrets.token_hex(12)
    number = 0

    def typed(kind: str, **fields: Any) -> str:
        nonlocal number
        number += 1
        body = {"type": kind, "sequence_number": number, **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    started = responses.response_body(
        rid=pending, model=model, request=asked, text="", status="in_progress"
    )
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    text = ""
    try:
        yield typed("response.created", response=started)
        yield typed("response.in_progress", response=started)
        yield typed(
            "response.output_item.added",
            output_index=0,
            item=responses.message_item(item_id, "", "in_progress") | {"content": []},
        )
        empty = {"type": "output_text", "text": "", "annotations": []}
        yield typed("response.content_part.added", **where, part=empty)
        kind, payload = first
        while True:
            if kind == "text":
                text += payload
                yield typed("response.output_text.delta", **where, delta=payload)
            elif kind == "done":
                final = finished_response(payload, asked, model, extension)
                final["output"][0]["id"] = item_id
                part = final["output"][0]["content"][0]
                yield typed("response.output_text.done", **where, text=part["text"])
                yield typed("response.content_part.done", **where, part=part)
                yield typed("response.output_item.done", output_index=0, item=final["output"][0])
                done = (
                    "response.completed"
                    if final["status"] == "completed"
                    else ("response.incomplete")
                )
                yield typed(done, response=final)
                return
            elif kind == "error":
                yield typed("error", **payload.body()["error"])
                return
            kind, payload = await events.get()
    finally:
        job.cancel.set()
