"""What the next save of a conversation writes: the bookkeeping between two saves.

A save writes one turn record holding the messages and token ids added since the last
save, the sizes of the forward calls that fed them (``kvchat repair`` replays them: the
same rows fed in other chunks give other bits) and the cache's state from the position
the last save reached. When the template rewrote earlier turns, the state was rebuilt from
the text: that save is a rebase, carrying the whole state and every token id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TurnLog:
    saved_upto: int = 0  # cache positions already in the conversation's files
    messages: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # rows of each forward call
    rebase: bool = False  # the state was rebuilt from text: the next save writes it whole

    def note_turn(self, messages: list[dict[str, Any]], token_ids: list[int]) -> None:
        self.messages += messages
        self.token_ids += token_ids

    def seed(self, messages: list[dict[str, Any]]) -> None:
        """Earlier turns known only as text: saved with the next turn."""
        self.messages = [dict(m) for m in messages]

    def restart_from_text(self) -> None:
        """The cache was rebuilt from the text: its calls so far are gone, and the next
        save replaces the saved state."""
        self.calls = []
        self.rebase = True

    @property
    def since(self) -> int:
        """The first position the next save writes."""
        return 0 if self.rebase else self.saved_upto

    def saved(self, n_cached: int) -> None:
        """A save reached ``n_cached``: nothing is pending."""
        self.saved_upto = n_cached
        self.messages, self.token_ids, self.calls = [], [], []
        self.rebase = False
