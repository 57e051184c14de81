"""What the chat app needs from an engine, as a small interface of plain values.

The app never touches tensors: it talks to a :class:`Backend`, gets strings, dicts, memory
snapshots (plain numbers) and the dataclasses below back, and never imports torch.
:class:`~kvchat.ui.engine_backend.EngineBackend` wraps the real engine; ``tests/ui/fakes.py``
has a fake that streams canned words.

Threading contract: the app calls ``load``, ``send``, ``memory``, ``set_system``,
``new_conversation`` and ``open_conversation`` on its one engine thread, in order, never two
at once (the engine's session is not thread safe); ``memory`` is also called from inside
``on_text``, on the thread running ``send``. ``process_rss`` and ``list_conversations``
(which touch no session) may be called from any thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvchat.engine.chat.memory_snapshot import MemorySnapshot
from kvchat.engine.chat.settings import SamplingSettings

Progress = Callable[[str], None]


@dataclass
class ModelView:
    """The loaded model, as the status line shows it."""

    name: str
    dtype: str = ""
    device: str = ""
    weights_bytes: int = 0
    chat_template: bool = True


@dataclass
class TurnView:
    """One finished reply: ``finish_reason`` is eos, length, stop or cancelled."""

    reply: str
    finish_reason: str
    memory: MemorySnapshot
    tokens: int = 0
    tokens_per_second: float = 0.0
    save_error: str | None = None  # why this turn (and any unsaved before it) is not on disk

    @property
    def cancelled(self) -> bool:
        return self.finish_reason == "cancelled"


@dataclass
class ResumedConversation:
    """A saved conversation, reopened: its text and, where saved, memory after each turn."""

    id: str
    title: str
    messages: list[dict[str, str]]
    memory_history: list[MemorySnapshot] = field(default_factory=list)
    system: str | None = None
    forked_from: str | None = None  # set by ``branch``: the conversation it branched from


@dataclass
class LaunchOptions:
    """What the user asked for on the command line, shown before the model is loaded."""

    model: str
    cache_kind: str = "kvdirect"
    max_mem: int | None = None
    system: str | None = None
    conversation_id: str | None = None  # `kvchat resume ID`: open it once loaded

    @classmethod
    def from_cli(cls, opts: dict[str, Any]) -> LaunchOptions:
        from kvchat.engine.chat.settings import EngineOptions
        from kvchat.engine.models.registry import DEFAULT_MODEL

        options = EngineOptions.from_cli(opts)
        return cls(
            model=options.model.model or DEFAULT_MODEL,
            cache_kind=options.cache.kind,
            max_mem=options.cache.max_mem,
            system=opts.get("system"),
            conversation_id=opts.get("conversation_id"),
        )


class Backend(Protocol):
    """The engine as the app sees it. Every user error is a one-line ``KvchatError``."""

    launch: LaunchOptions

    def load(self, progress: Progress, spec: str | None = None) -> ModelView:
        """Load the model (``spec`` replaces the launch model) and start a conversation."""
        ...

    def send(
        self,
        text: str,
        sampling: SamplingSettings,
        *,
        on_text: Callable[[str], None],
        should_stop: Callable[[], bool],
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnView:
        """Answer ``text``, streaming pieces of the reply through ``on_text``;
        ``on_progress(done, total)`` while the prompt is read."""
        ...

    def memory(self) -> MemorySnapshot:
        """The conversation's memory right now (call it from the thread that sends)."""
        ...

    def process_rss(self) -> int | None:
        """Resident set size of this process in bytes (thread safe)."""
        ...

    def set_system(self, system: str | None) -> None:
        """Change the system prompt of the current conversation."""
        ...

    def new_conversation(self, system: str | None) -> None:
        """Drop the current conversation and start an empty one."""
        ...

    def list_conversations(self) -> list[dict[str, Any]]:
        """Saved conversations, most recent first: id, title, model, turns, tokens,
        bytes_on_disk, last_used (ISO text), error (one line, or None), forked_from ({id,
        turn} or None) and text (every message, lower-cased, for searching)."""
        ...

    def open_conversation(self, conv_id: str) -> ResumedConversation:
        """Resume a saved conversation from its residual files."""
        ...

    def branch(self, user_message: int) -> ResumedConversation:
        """Fork the current saved conversation just before its ``user_message``-th user
        message (1-based) and go on in the fork, which is returned as resumed; the original
        stays as it was (F4 lists both). Regenerate is a branch before the last message."""
        ...

    def close(self) -> None:
        """Release the model and any open conversation."""
        ...
