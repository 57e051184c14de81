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
from kvchat.errors import KvchatError
from kvchat.threads import counts as thread_counts

if TYPE_CHECKING:
    from kvchat.storage import Conversation, ConversationStore


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
                    **session.cache_settings.as_dict(),  # with the K/V dtype resolved
                },
            )
            say(f"saving as conversation {conversation.id}")
            return conversation

        session.save_on_first_turn(create)
    return session


def regenerable_prompt(store: ConversationStore, conversation_id: str) -> str:
    """The prompt to answer again when regenerating a conversation's last reply: the one
    user message its last turn added. KvchatError (one line, with what to do) otherwise."""
    cid = store.resolve(conversation_id)
    turns = store.summary(cid).turns
    if turns == 0:
        raise KvchatError(f"conversation {cid} has no reply to regenerate yet; send a prompt")
    asked = [m["content"] for m in store.turn_messages(cid, turns) if m["role"] == "user"]
    if len(asked) != 1:
        raise KvchatError(
            f"turn {turns} of conversation {cid} holds {len(asked)} prompts (saved together "
            f"after a failed save); fork it at turn {turns - 1} (`kvchat fork {cid} --turn "
            f"{turns - 1}`) and send them again"
        )
    return asked[0]


def turn_before_message(store: ConversationStore, conversation_id: str, user_message: int) -> int:
    """The turn to fork at so that the conversation goes on just before its
    ``user_message``-th user message (1-based): an edit of that message branches there.
    KvchatError (one line, with what to do) when that message shares its turn with another
    prompt (saved together after a failed save) or its turn kept no record of its own."""
    cid = store.resolve(conversation_id)
    counts = store.message_counts(cid)
    messages = store.read(cid).messages
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not 1 <= user_message <= len(users):
        raise KvchatError(
            f"conversation {cid} has {len(users)} saved message(s) of yours, not "
            f"{user_message}; wait for the reply to be saved, then edit"
        )
    at = users[user_message - 1]
    turn = next(i for i, n in enumerate(counts, start=1) if n is not None and n > at)
    start = 0 if turn == 1 else counts[turn - 2]
    if start is None or sum(1 for i in users if start <= i < (counts[turn - 1] or 0)) != 1:
        raise KvchatError(
            f"message {user_message} of conversation {cid} shares its saved turn with another "
            "prompt (saved together after a failed save) or was saved by an older kvchat; "
            f"fork it with `kvchat fork {cid} --turn N` instead"
        )
    return turn - 1


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
