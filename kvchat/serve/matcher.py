"""Which saved conversation a request continues, and from which of its turns.

A client of a stateless API sends the whole conversation every time. The request
continues a saved conversation when everything before its new user message (the system
prompt, then each user and assistant message) is exactly that conversation's messages:
then the conversation's files hold the model state for all of it, and only the new turn
needs feeding. When it is exactly the conversation's messages as they stood after an
earlier turn k (an edited last message, a regenerated reply, a branch), the request
branches there: the worker forks the conversation at turn k and feeds only what follows.
Anything else (an edited reply, a history that differs inside a turn) matches nothing,
and the engine starts from text.

Reads manifests through the store's public, lock-free ``list``, ``export`` and
``message_counts``; what it has read is cached per conversation and revision, so a request
costs one directory scan.
"""

from __future__ import annotations

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
    system: str | None
    messages: Messages
    counts: tuple[int | None, ...]  # messages held after each turn


@dataclass(frozen=True)
class Match:
    """A saved conversation whose state after ``turn`` (of ``turns``) is the request's
    history: continued when ``turn == turns``, forked at ``turn`` otherwise."""

    conversation: str
    turn: int
    turns: int

    @property
    def continues(self) -> bool:
        return self.turn == self.turns


class ConversationMatcher:
    """Finds the saved conversation of one model whose state a request's history is."""

    def __init__(self, store: ConversationStore, model_name: str) -> None:
        self.store = store
        self.model_name = model_name
        self._entries: dict[str, _Entry] = {}

    def find(self, system: str | None, history: list[dict[str, str]]) -> Match | None:
        """The most recently used conversation that holds exactly these messages, after
        its last turn (preferred: nothing to fork) or after an earlier one."""
        if not history:
            return None  # a first turn: always a new conversation
        wanted_system, wanted = message_key(system, history)
        branch = None
        for summary in self.store.list():  # most recently used first
            if summary.error or summary.model != self.model_name or not summary.turns:
                continue
            entry = self._entry(summary)
            if entry is None or entry.system != wanted_system:
                continue
            if len(wanted) not in entry.counts or entry.messages[: len(wanted)] != wanted:
                continue
            turn = entry.counts.index(len(wanted)) + 1
            # The last turn holding that many messages: a turn that added none (a save that
            # only re-pointed state) is still the same state.
            while turn < len(entry.counts) and entry.counts[turn] == len(wanted):
                turn += 1
            found = Match(summary.id, turn, len(entry.counts))
            if found.continues:
                return found
            branch = branch or found
        return branch

    def _entry(self, summary: ConversationSummary) -> _Entry | None:
        revision = (summary.last_used, summary.turns, summary.tokens)
        cached = self._entries.get(summary.id)
        if cached is not None and cached.revision == revision:
            return cached
        try:
            saved = self.store.read(summary.id)
            counts = tuple(self.store.message_counts(summary.id))
        except (KvchatError, ValueError, OSError):
            return None  # deleted or unreadable meanwhile: it cannot be continued anyway
        system = (saved.settings or {}).get("system")
        _, messages = message_key(system, saved.messages or [])
        entry = _Entry(revision, system, messages, counts)
        self._entries[summary.id] = entry
        return entry


def history_at(
    store: ConversationStore, model_name: str, conversation: str, turn: int
) -> tuple[str | None, list[dict[str, str]]]:
    """``(system, messages)`` of a saved conversation as it stood after ``turn``: what a
    Responses API ``previous_response_id`` continues. RequestError when there is none."""
    from kvchat.serve.protocol import RequestError

    missing = RequestError(
        f"Previous response with id 'resp_{conversation}_{turn}' not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )
    try:
        summary = store.summary(conversation)
        if summary.id != conversation or summary.model != model_name or summary.error:
            raise missing
        counts = store.message_counts(conversation)
        saved = store.read(conversation)
    except (KvchatError, ValueError, OSError):
        raise missing from None
    if not 1 <= turn <= len(counts) or counts[turn - 1] is None:
        raise missing
    messages = [
        {"role": m["role"], "content": m["content"]} for m in saved.messages[: counts[turn - 1]]
    ]
    return (saved.settings or {}).get("system"), messages
