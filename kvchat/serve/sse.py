"""Server-sent events for a streamed chat completion, in OpenAI's chunk shapes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvchat.serve import protocol
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
