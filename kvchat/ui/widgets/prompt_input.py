"""The message box: a multi-line ``TextArea`` where Enter sends.

Shift+Enter and Ctrl+J add a newline (most terminals send Shift+Enter as a plain Enter; Ctrl+J
works everywhere). Up in an empty box recalls earlier messages.
"""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "newline")


class PromptInput(TextArea):
    BINDINGS = [
        Binding("enter", "submit", "Send", key_display="⏎"),
        Binding("ctrl+j", "newline", "Newline", key_display="^j", show=False),
    ]

    class Submitted(Message):
        def __init__(self, prompt: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("placeholder", "Message (⏎ send, ^j newline, /help for commands)")
        super().__init__(soft_wrap=True, tab_behavior="focus", **kwargs)
        self.sent_history: list[str] = []
        self._recall = 0

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.action_submit()
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.action_newline()
            return
        recalling = not self.text or self._recall > 0
        if event.key == "up" and recalling and self.cursor_location[0] == 0 and self.sent_history:
            event.stop()
            event.prevent_default()
            self._recall = min(self._recall + 1, len(self.sent_history))
            self.load_text(self.sent_history[-self._recall])
            return
        await super()._on_key(event)

    def action_newline(self) -> None:
        self.insert("\n")

    def action_submit(self) -> None:
        text = self.text.strip()
        if text:
            self.post_message(self.Submitted(self, text))

    def accept(self, text: str) -> None:
        """The app took ``text``: remember it and empty the box."""
        if not self.sent_history or self.sent_history[-1] != text:
            self.sent_history.append(text)
        self._recall = 0
        self.clear()
