"""The HTTP surface: routes, body limits, auth, and turning worker events into replies."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvchat.serve import protocol
from kvchat.serve.auth import bearer_matches
from kvchat.serve.matcher import history_at
from kvchat.serve.protocol import ChatRequest, RequestError
from kvchat.serve.responses import parse_responses_request
from kvchat.serve.sse import finished_response, stream_completion, stream_response
from kvchat.serve.worker import EngineWorker, Job, TurnReply

MAX_BODY_BYTES = 4 * 1024 * 1024
CONVERSATION_HEADER = "X-Kvchat-Conversation"


def error_response(exc: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_big = RequestError(f"the request body is over {limit // 1024} KiB; send a shorter one")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def extension(reply: TurnReply) -> dict[str, Any]:
    """The ``kvchat`` field: which conversation, and what continuing it cost."""
    return {
        "conversation": reply.conversation,
        "saved": reply.conversation is not None,
        "prefilled_tokens": reply.prefilled_tokens,
        "tokens": reply.tokens,
        "finish_reason": reply.finish_reason,
        "error": reply.error,
    }


def create_app(
    worker: EngineWorker,
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> Starlette:
    def denied(request: Request) -> JSONResponse | None:
        if api_key is None or bearer_matches(request.headers.get("authorization"), api_key):
            return None
        exc = RequestError(
            "Incorrect or missing API key; send it as 'Authorization: Bearer KEY'",
            status=401,
            code="invalid_api_key",
        )
        return error_response(exc, headers={"WWW-Authenticate": "Bearer"})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        if (refusal := denied(request)) is not None:
            return refusal
        entry = {"id": model_name, "object": "model", "created": 0, "owned_by": "kvchat"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def start(chat: ChatRequest) -> tuple[Job, asyncio.Queue, tuple[str, Any], dict]:
        """Queue a turn and wait until it starts: its job, its events, the first event after
        the start and the conversation header. RequestError when the queue refuses it."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(kind: str, payload: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

        job = Job(chat, emit)
        worker.submit(job)
        try:
            conversation, first = await _first_event(events)
        except BaseException:
            job.cancel.set()  # cancelled while waiting in the queue: do not run it
            raise
        return job, events, first, {CONVERSATION_HEADER: conversation} if conversation else {}

    async def chat_completions(request: Request) -> Response:
        if (refusal := denied(request)) is not None:
            return refusal
        try:
            chat = protocol.parse_chat_request(await read_body(request, max_body_bytes))
        except RequestError as exc:
            return error_response(exc)
        try:
            job, events, first, headers = await start(chat)
        except RequestError as exc:
            return error_response(exc)
        if first[0] == "error":
            return error_response(first[1], headers=headers)
        completion_id = protocol.new_completion_id()
        if chat.stream:
            headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return StreamingResponse(
                stream_completion(
                    job=job,
                    first=first,
                    events=events,
                    completion_id=completion_id,
                    model=model_name,
                    extension=extension,
                ),
                media_type="text/event-stream",
                headers=headers,
            )
        kind, payload = await last_event(job, events, first)
        if kind == "error":
            return error_response(payload, headers=headers)
        reply: TurnReply = payload
        if reply.conversation:
            headers[CONVERSATION_HEADER] = reply.conversation
        body = protocol.completion_body(
            completion_id=completion_id,
            model=model_name,
            content=reply.content,
            finish=protocol.finish_reason(reply.finish_reason, reply.stopped_by_sequence),
            usage_=protocol.usage(reply.prompt_tokens, len(reply.tokens), reply.cached_tokens),
            extension=extension(reply),
        )
        return JSONResponse(body, headers=headers)

    def history_of(conversation: str, turn: int) -> tuple[str | None, list[dict[str, str]]]:
        return history_at(worker.matcher.store, model_name, conversation, turn)

    async def responses(request: Request) -> Response:
        if (refusal := denied(request)) is not None:
            return refusal
        try:
            asked = await asyncio.to_thread(
                parse_responses_request, await read_body(request, max_body_bytes), history_of
            )
        except RequestError as exc:
            return error_response(exc)
        try:
            job, events, first, headers = await start(asked.chat)
        except RequestError as exc:
            return error_response(exc)
        if first[0] == "error":
            return error_response(first[1], headers=headers)
        if asked.chat.stream:
            headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return StreamingResponse(
                stream_response(
                    job=job, first=first, events=events, asked=asked, model=model_name,
                    extension=extension,
                ),
                media_type="text/event-stream",
                headers=headers,
            )  # fmt: skip
        kind, payload = await last_event(job, events, first)
        if kind == "error":
            return error_response(payload, headers=headers)
        return JSONResponse(
            finished_response(payload, asked, model_name, extension), headers=headers
        )

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = {404: "no such endpoint", 405: "method not allowed"}.get(
            exc.status_code, str(exc.detail)
        )
        return JSONResponse(protocol.error_body(message), status_code=exc.status_code)

    async def server_error(request: Request, exc: Exception) -> Response:
        body = protocol.error_body("internal server error; see the server log", kind="server_error")
        return JSONResponse(body, status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.close)  # waits for the save in progress

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )


async def last_event(job: Job, events: asyncio.Queue, first: tuple[str, Any]) -> tuple[str, Any]:
    """The turn's last event (done or error), the text events before it skipped."""
    try:
        kind, payload = first
        while kind == "text":
            kind, payload = await events.get()
    except BaseException:
        job.cancel.set()
        raise
    return kind, payload


async def _first_event(events: asyncio.Queue) -> tuple[str | None, tuple[str, Any]]:
    """The conversation id (when the turn started) and the first text, done or error."""
    conversation = None
    while True:
        kind, payload = await events.get()
        if kind != "session":
            return conversation, (kind, payload)
        conversation = payload
