"""Which saved conversation a request continues.

A client of a stateless API sends the whole conversation every time. The request
continues a saved conversation when everything before its new user message (the system
prompt, then each user and assistant message) is exactly that conversation's messages:
then the conversation's files hold the model state for all of it, and only the new turn
needs feeding. Anything else (an edited reply, a branch from an earlier turn) matches
nothing, and the engine would have to start from text.

Reads manifests through the store's public, lock-free ``list`` and ``export``; what it
has read is cached per conversation and revision, so a request costs one directory scan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvchat.errors import KvchatError
from kvchat.storage import ConversationStore, ConversationSummary

Messages = tuple[tuple[str, str], ...]


def message_key(system: str | None, messages: list[dict[str, str]]) -> tuple[Any, Messages]:
    """What must be equal for a request to continue a conversation."""
    return system, tuple((m["role"], m["content"]) for m in messages)


@dataclass(frozen=True)
class _Entry:
    revision: tuple[Any, ...]
    key: tuple[Any, Messages]


class ConversationMatcher:
    """Finds the saved conversation of one model whose messages a request extends."""

    def __init__(self, store: ConversationStore, model_name: str) -> None:
        self.store = store
        self.model_name = model_name
        self._entries: dict[str, _Entry] = {}

    def find(self, system: str | None, history: list[dict[str, str]]) -> str | None:
        """Id of the most recently used conversation with exactly these messages."""
        if not history:
            return None  # a first turn: always a new conversation
        wanted = message_key(system, history)
        for summary in self.store.list():  # most recently used first
            if summary.error or summary.model != self.model_name or not summary.turns:
                continue
            entry = self._entry(summary)
            if entry is not None and entry.key == wanted:
                return summary.id
        return None

    def _entry(self, summary: ConversationSummary) -> _Entry | None:
        revision = (summary.last_used, summary.turns, summary.tokens)
        cached = self._entries.get(summary.id)
        if cached is not None and cached.revision == revision:
            return cached
        try:
            doc = json.loads(self.store.export(summary.id, "json"))
        except (KvchatError, ValueError, OSError):
            return None  # deleted or unreadable meanwhile: it cannot be continued anyway
        system = (doc.get("settings") or {}).get("system")
        entry = _Entry(revision, message_key(system, doc.get("messages") or []))
        self._entries[summary.id] = entry
        return entry
