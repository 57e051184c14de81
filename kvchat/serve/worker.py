"""The single engine worker: one thread, one queue, one active conversation.

A chat session is not thread-safe and the model's memory ceiling is for the whole server,
so every request is served in turn on this thread. Only the active conversation is held
in memory; switching to another closes it (its files already hold every finished turn)
and resumes the other from its files.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.engine.chat import prompt
from kvchat.engine.chat.conversation import open_session
from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings
from kvchat.engine.models.loaded import LoadedModel
from kvchat.errors import CeilingTooSmallError, KvchatError, NeedsDiskTierError, StorageError
from kvchat.serve.matcher import ConversationMatcher, Match, message_key
from kvchat.serve.protocol import DEFAULT_MAX_TOKENS, ChatRequest, RequestError
from kvchat.serve.redact import Redactor
from kvchat.serve.stops import StopScanner
from kvchat.storage import ConversationLockedError, ConversationStore, ModelMismatchError

MAX_QUEUED = 64

# What a job reports, in order: ("session", conversation id or None) once the turn
# starts, ("text", str)*, then one ("done", TurnReply) or
# ("error", RequestError). Called on the worker thread; the app hands it to its loop.
Emit = Callable[[str, Any], None]


@dataclass
class Job:
    request: ChatRequest
    emit: Emit
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class TurnReply:
    content: str
    finish_reason: str  # the engine's: eos | length | stop | cancelled | ceiling
    stopped_by_sequence: bool
    prompt_tokens: int  # the whole conversation before the reply
    prefilled_tokens: int  # what this turn had to feed (small when continuing)
    tokens: list[int]
    conversation: str | None  # None: answered from text, not saved
    error: str | None = None
    cached_tokens: int = 0  # of prompt_tokens, those whose saved state was reused, not fed
    turn: int | None = None  # the saved turn this reply is (None: not saved)


class EngineWorker:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        cache: CacheSettings,
        data_dir: Path,
        say: Callable[[str], None] = lambda _m: None,
    ) -> None:
        from kvchat.engine.chat.settings import kv_dtype_for

        # Sessions are opened per request: a --kv-dtype this model cannot take is refused
        # at startup instead of failing every request.
        kv_dtype_for(cache.kv_dtype, loaded.dtype)
        self.loaded = loaded
        self.cache = cache
        self.data_dir = Path(data_dir)
        self.say = say
        self.redact = Redactor(self.data_dir)
        self.matcher = ConversationMatcher(ConversationStore(self.data_dir), loaded.name)
        self.context_length = prompt.context_length(loaded.model.config)
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=MAX_QUEUED)
        self._active: ChatSession | None = None
        self._current: Job | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvchat-engine")

    # -- lifecycle (event-loop thread) -------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._stopping.is_set():
            raise RequestError("the server is shutting down; retry once it is back", status=503)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise RequestError(
                f"{MAX_QUEUED} requests are already waiting; retry later", status=503
            ) from None

    def begin_shutdown(self) -> None:
        """Stop the reply in progress at its next token (it is still saved) and refuse
        what waits; ``close`` then waits for the save."""
        self._stopping.set()
        current = self._current
        if current is not None:
            current.cancel.set()

    def close(self) -> None:
        self.begin_shutdown()
        if self._thread.is_alive():
            self._queue.put(None)  # the loop refuses what waits, so this soon fits
            self._thread.join()
            self._close_active()
            self.say("stopped; every finished turn is saved")
        self._close_active()

    # -- the worker thread -------------------------------------------------------------
    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            if self._stopping.is_set():
                job.emit("error", RequestError("the server is shutting down", status=503))
            elif not job.cancel.is_set():  # else the client left while it waited
                self._run(job)

    def _run(self, job: Job) -> None:
        self._current = job
        try:
            job.emit("done", self._serve(job))
        except RequestError as exc:
            job.emit("error", exc)
        except KvchatError as exc:
            job.emit("error", RequestError(self.redact(str(exc)), status=500, kind="server_error"))
        except Exception as exc:  # noqa: BLE001 - one bad turn must not stop the server
            self._close_active()  # its state is in doubt; the next turn resumes from files
            self.say(f"a turn failed: {type(exc).__name__}: {exc}")
            message = f"the turn failed ({type(exc).__name__}); see the server log"
            job.emit("error", RequestError(message, status=500, kind="server_error"))
        finally:
            self._current = None

    def _serve(self, job: Job) -> TurnReply:
        request = job.request
        session = self._session_for(request)
        max_new = self._max_new_tokens(request)
        job.emit("session", session.conversation.id if session.conversation else None)
        scanner = StopScanner(request.stop)

        def on_text(delta: str) -> None:
            shown = scanner.feed(delta)
            if shown:
                job.emit("text", shown)

        cached = session.cached_tokens  # the state this turn starts from, reused as it is
        sampling = SamplingSettings(
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            max_new_tokens=max_new,
        )
        try:
            result = session.send(
                request.user,
                sampling,
                on_text=on_text,
                should_stop=lambda: job.cancel.is_set() or scanner.hit or self._stopping.is_set(),
            )
        except KvchatError as exc:
            # Raised before anything is fed: the session is as it was, nothing is saved.
            if session.conversation is None:
                self._close(session)
            ceiling = isinstance(exc, (CeilingTooSmallError, NeedsDiskTierError))
            code = "memory_ceiling_exceeded" if ceiling else None
            raise RequestError(self.redact(str(exc)), code=code) from None
        tail = scanner.flush()
        if tail:
            job.emit("text", tail)
        conversation = session.conversation.id if session.conversation is not None else None
        turn = None
        if conversation is not None and not result.save_error:
            turn = len(session.conversation.manifest.turns)
        if conversation is None:
            self._close(session)  # answered from text: nothing to keep in memory
        return TurnReply(
            content=scanner.text if scanner.hit else result.reply,
            finish_reason=result.finish_reason,
            stopped_by_sequence=scanner.hit,
            prompt_tokens=len(session.token_ids) - len(result.tokens),
            prefilled_tokens=result.prompt_tokens,
            cached_tokens=cached,
            turn=turn,
            tokens=list(result.tokens),
            conversation=conversation,
            error=self.redact(result.error) if result.error else None,
        )

    # -- which session serves a request ------------------------------------------------
    def _session_for(self, request: ChatRequest) -> ChatSession:
        if not request.save:  # answered from its text, and nothing of it kept
            self._close_active()
            session = open_session(
                self.loaded, data_dir=self.data_dir, cache=self.cache, system=request.system,
                save=False,
            )  # fmt: skip
            if request.history:
                session.seed_history(request.history)
            return session
        wanted = message_key(request.system, request.history)
        active = self._active
        if active is not None and message_key(active.system, active.messages) == wanted:
            return active
        self._close_active()
        found = self.matcher.find(request.system, request.history)
        conversation_id = None
        if found is not None:
            conversation_id = found.conversation if found.continues else self._fork(found)
        session = self._resume(conversation_id) if conversation_id is not None else None
        if session is None:
            session = open_session(
                self.loaded,
                data_dir=self.data_dir,
                cache=self.cache,
                system=request.system,
            )
            if request.history:
                # A history no saved conversation holds (an edited reply, a branch): it is
                # prefilled from its text once and saved whole as a new conversation.
                session.seed_history(request.history)
        self._active = session
        return session

    def _fork(self, found: Match) -> str | None:
        """A fork of ``found.conversation`` at ``found.turn``, for a request that branches
        there (an edited or regenerated last message); None when it cannot be made (the
        parent is open elsewhere, the disk is full): the history is then read from text."""
        try:
            fork = self.matcher.store.fork(found.conversation, turn=found.turn)
        except StorageError as exc:
            self.say(f"reading the history from text: {self.redact(str(exc))}")
            return None
        self.say(f"branching conversation {found.conversation} at turn {found.turn}: {fork}")
        return fork

    def _resume(self, conversation_id: str) -> ChatSession | None:
        """The saved conversation, ready for its next turn; None when it was saved with
        another dtype or model build (same name), so only its text can be used."""
        try:
            return open_session(
                self.loaded,
                data_dir=self.data_dir,
                cache=self.cache,
                conversation_id=conversation_id,
            )
        except ModelMismatchError:
            return None
        except ConversationLockedError:
            raise RequestError(
                f"conversation {conversation_id} is open in another kvchat process; close it "
                "there and retry",
                status=409,
                code="conversation_locked",
            ) from None
        except StorageError as exc:
            raise RequestError(
                self.redact(str(exc)),
                status=500,
                kind="server_error",
                code="conversation_unreadable",
            ) from None

    def _max_new_tokens(self, request: ChatRequest) -> int:
        limit = self.context_length
        if limit is None:
            return request.max_tokens or DEFAULT_MAX_TOKENS
        n_prompt = self.count_prompt_tokens(request)
        asked = request.max_tokens if request.max_tokens is not None else 1
        if n_prompt + asked > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {n_prompt + asked} tokens ({n_prompt} in the messages, {asked} in "
                "the completion). Shorten the messages or lower max_tokens.",
                param="messages",
                code="context_length_exceeded",
            )
        return request.max_tokens or min(DEFAULT_MAX_TOKENS, limit - n_prompt)

    def count_prompt_tokens(self, request: ChatRequest) -> int:
        """The tokens the conversation's text is, rendered as the session renders it."""
        messages = [m for m in request.messages if m["role"] != "system" or m["content"]]
        loaded = self.loaded
        text = prompt.render(loaded.tokenizer, loaded.has_chat_template, messages)
        return len(prompt.tokenize(loaded.tokenizer, text))

    def _close_active(self) -> None:
        if self._active is not None:
            session, self._active = self._active, None
            self._close(session)

    def _close(self, session: ChatSession) -> None:
        if session is self._active:
            self._active = None
        try:
            session.close()
        except Exception as exc:  # noqa: BLE001 - closing must not take the server down
            self.say(f"closing a conversation failed: {exc}")
