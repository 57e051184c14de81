"""The real engine behind the app: a :class:`~kvchat.engine.chat.session.ChatSession`.

Everything heavy (torch, transformers, the storage layer, which imports torch) is imported
inside the methods, which the app runs in worker threads, so importing this module costs
nothing and the window appears before the model starts loading.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvchat.engine.chat.settings import EngineOptions, SamplingSettings
from kvchat.engine.models.registry import DEFAULT_MODEL
from kvchat.errors import KvchatError
from kvchat.ui.backend import (
    LaunchOptions,
    MemorySnapshot,
    ModelView,
    Progress,
    ResumedConversation,
    TurnView,
)

if TYPE_CHECKING:
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.models.loaded import LoadedModel

__all__ = ["DEFAULT_MODEL", "EngineBackend"]


class EngineBackend:
    """Adapts the engine to :class:`kvchat.ui.backend.Backend`. Built from the CLI options."""

    def __init__(self, opts: dict[str, Any]) -> None:
        self.opts = dict(opts)
        self.options = EngineOptions.from_cli(self.opts)
        self.launch = LaunchOptions.from_cli(self.opts)
        self._loaded: LoadedModel | None = None
        self._session: ChatSession | None = None

    # -- model -----------------------------------------------------------------------------
    def load(self, progress: Progress, spec: str | None = None) -> ModelView:

        from kvchat.engine.models.load import load_with

        if spec:
            self.launch.model = spec
        self.close()
        settings = dataclasses.replace(self.options.model, model=self.launch.model)
        loaded = load_with(settings, progress=progress)
        self._loaded = loaded
        progress("starting the conversation")
        self._session = self._new_session(self.launch.system)
        return ModelView(
            name=loaded.name,
            dtype=loaded.dtype,
            device=str(loaded.device),
            weights_bytes=loaded.weights_bytes,
            chat_template=loaded.has_chat_template,
        )

    def _new_session(self, system: str | None, conversation_id: str | None = None) -> ChatSession:
        from kvchat.engine.chat.conversation import open_session

        return open_session(
            self._loaded,
            data_dir=self.opts.get("data_dir"),
            cache=dataclasses.replace(self.options.cache),  # each session its own
            system=system or None,
            conversation_id=conversation_id,
            save=not self.opts.get("no_save"),
        )

    def _require_session(self) -> ChatSession:
        if self._session is None:
            raise KvchatError("the model is not loaded yet; wait for it, or restart kvchat")
        return self._session

    # -- a turn ----------------------------------------------------------------------------
    def send(
        self,
        text: str,
        sampling: SamplingSettings,
        *,
        on_text: Callable[[str], None],
        should_stop: Callable[[], bool],
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnView:
        session = self._require_session()
        result = session.send(
            text, sampling, on_text=on_text, should_stop=should_stop, on_progress=on_progress
        )
        return TurnView(
            reply=result.reply,
            finish_reason=result.finish_reason,
            memory=result.memory,
            tokens=len(result.tokens),
            tokens_per_second=result.decode_tokens_per_second,
            save_error=result.save_error,
        )

    def memory(self) -> MemorySnapshot:
        return self._require_session().memory()

    def process_rss(self) -> int | None:
        import psutil

        return psutil.Process().memory_info().rss

    # -- conversations ---------------------------------------------------------------------
    def set_system(self, system: str | None) -> None:
        # The next turn sees the new prompt; the session notices that the rendered prefix
        # changed and rebuilds its state from the text.
        self._require_session().system = system or None

    def new_conversation(self, system: str | None) -> None:
        self._require_session()
        self._session.close()
        self._session = self._new_session(system)

    def list_conversations(self) -> list[dict[str, Any]]:
        from kvchat.paths import data_dir
        from kvchat.storage import ConversationStore

        rows = []
        store = ConversationStore(data_dir(self.opts.get("data_dir")))
        for s in store.list():
            rows.append(
                {
                    "id": s.id,
                    "title": s.title,
                    "model": s.model,
                    "turns": s.turns,
                    "tokens": s.tokens,
                    "bytes_on_disk": s.bytes_on_disk,
                    "last_used": s.last_used.isoformat(timespec="minutes"),
                    "error": s.error,
                    "forked_from": (
                        None
                        if s.forked_from is None
                        else {"id": s.forked_from.id, "turn": s.forked_from.turn}
                    ),
                    "text": "" if s.error else _search_text(store, s.id),
                }
            )
        return rows

    def open_conversation(self, conv_id: str) -> ResumedConversation:
        from kvchat.engine.chat.conversation import resumed_view

        self._require_session()
        current = self._session.conversation
        if current is not None and conv_id and current.id.startswith(conv_id):
            view = resumed_view(self._session)
        else:
            # Release the current conversation's lock first: it may be the one asked for.
            self._session.close()
            try:
                self._session = self._new_session(None, conversation_id=conv_id)
            except BaseException:
                # Keep a usable session (the one closed above is saved and can be resumed);
                # the UI shows the error.
                self._session = self._new_session(None)
                raise
            view = resumed_view(self._session)
        return ResumedConversation(**view)

    def branch(self, user_message: int) -> ResumedConversation:
        from kvchat.engine.chat.conversation import resumed_view, turn_before_message
        from kvchat.paths import data_dir
        from kvchat.storage import ConversationStore

        session = self._require_session()
        conversation = session.conversation
        if conversation is None:
            raise KvchatError(
                "this conversation is not saved yet (or kvchat runs with --no-save), so there "
                "is no turn to branch from"
            )
        if len(session.messages) != len(conversation.manifest.messages):
            raise KvchatError(
                "the last turn is not saved yet; once a save succeeds you can edit or regenerate"
            )
        store = ConversationStore(data_dir(self.opts.get("data_dir")))
        turn = turn_before_message(store, conversation.id, user_message)
        parent = conversation.id
        session.close()  # a fork needs its parent's lock
        try:
            fork = store.fork(parent, turn=turn)
        except BaseException:
            self._session = self._new_session(None, conversation_id=parent)
            raise
        self._session = self._new_session(None, conversation_id=fork)
        return ResumedConversation(**resumed_view(self._session), forked_from=parent)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
        self._session = None
        self._loaded = None


def _search_text(store: Any, conv_id: str) -> str:
    """Every message of a conversation, lower-cased, for F4's search (read lock-free)."""
    try:
        messages = store.read(conv_id).messages
    except (KvchatError, ValueError, KeyError, OSError):
        return ""
    return "\n".join(m.get("content", "") for m in messages).lower()
