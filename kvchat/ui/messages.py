"""Messages the engine thread posts to the app (``post_message`` is thread safe)."""

from __future__ import annotations

from textual.message import Message

from kvchat.engine.chat.settings import SamplingSettings
from kvchat.ui.backend import MemorySnapshot, ModelView, ResumedConversation, TurnView


class PrefillProgress(Message):
    """How much of a long prompt the engine has read (prefill), for the status line."""

    def __init__(self, done: int, total: int) -> None:
        super().__init__()
        self.done = done
        self.total = total


class LoadProgress(Message):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class Loaded(Message):
    def __init__(self, model: ModelView) -> None:
        super().__init__()
        self.model = model


class EngineFailed(Message):
    """A one-line error from the engine; ``what`` says which step failed."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__()
        self.what = what
        self.message = message


class ReplyChunk(Message):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class MemoryUpdate(Message):
    def __init__(self, memory: MemorySnapshot) -> None:
        super().__init__()
        self.memory = memory


class ReplyDone(Message):
    def __init__(self, turn: TurnView) -> None:
        super().__init__()
        self.turn = turn


class ConversationStarted(Message):
    """``/new`` done, or a saved conversation resumed (``resumed`` set)."""

    def __init__(self, resumed: ResumedConversation | None = None) -> None:
        super().__init__()
        self.resumed = resumed


class Branched(Message):
    """A branch was made and opened (regenerate, edit): ``text`` is to be sent in it."""

    def __init__(
        self, resumed: ResumedConversation, text: str, sampling: SamplingSettings, how: str
    ) -> None:
        super().__init__()
        self.resumed = resumed
        self.text = text
        self.sampling = sampling
        self.how = how
