"""Starting a conversation: new and saved, new and unsaved, or resumed from its files.

The one place the CLI and the UI go through, so both save and resume the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.engine.chat.memory_snapshot import MemorySnapshot
from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings
from kvchat.engine.models.loaded import LoadedModel
from kvchat.threads import counts as thread_counts

if TYPE_CHECKING:
    from kvchat.storage import Conversation


def open_session(
    loaded: LoadedModel,
    *,
    data_dir: str | Path | None,
    cache: CacheSettings,
    system: str | None = None,
    conversation_id: str | None = None,
    save: bool = True,
    say: Callable[[str], None] = lambda _m: None,
) -> ChatSession:
    """A session ready for its next turn.

    Resuming locks the conversation (a second process gets a clear error), checks that it
    was saved with this model and dtype, and rebuilds the cache from its residual files.
    """
    from kvchat.paths import data_dir as resolve_data_dir
    from kvchat.storage import ConversationStore

    root = resolve_data_dir(data_dir)
    store = ConversationStore(root)
    if conversation_id:
        conversation = store.open(
            conversation_id,
            fingerprint=loaded.fingerprint,
            dtype=loaded.dtype,
            model_name=loaded.name,
            weights=loaded.weights_mode,
        )
        try:
            session = ChatSession.resume(loaded, conversation, cache, spill_root=root)
        except BaseException:
            conversation.close()
            raise
        say(f"resumed conversation {conversation.id} ({len(conversation.manifest.turns)} turns)")
        return session
    session = ChatSession(loaded, system=system, cache=cache, spill_root=root)
    if save:

        def create() -> Conversation:
            conversation = store.create(
                model_name=loaded.name,
                fingerprint=loaded.fingerprint,
                dtype=loaded.dtype,
                settings={
                    "system": system,
                    "weights": loaded.weights_mode,
                    **thread_counts(),
                    **cache.as_dict(),
                },
            )
            say(f"saving as conversation {conversation.id}")
            return conversation

        session.save_on_first_turn(create)
    return session


def resumed_view(session: ChatSession) -> dict[str, Any]:
    """Plain values for a UI: id, title, messages, system prompt, memory after each turn."""
    conversation = session.conversation
    manifest = conversation.manifest
    return {
        "id": conversation.id,
        "title": manifest.title,
        "messages": [dict(m) for m in manifest.messages],
        "system": session.system,
        "memory_history": [MemorySnapshot.from_dict(t.extra.get("memory")) for t in manifest.turns],
    }
