"""The message list: user messages as plain text, replies as Markdown that grows as it streams."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

FINISH_NOTES = {
    "cancelled": "stopped",
    "length": "stopped at the token limit",
    "stop": "",
    "eos": "",
}


class MessageView(Vertical):
    """One message. ``role`` is user, assistant or note (kvchat talking, not the model)."""

    def __init__(self, role: str, text: str = "", label: str | None = None) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self.text = text
        self.label = label or {"user": "you", "assistant": "assistant", "note": "kvchat"}[role]
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Static(self.label, classes="who", markup=False)
        if self.role == "assistant":
            yield Markdown(self.text, classes="body")
        else:
            yield Static(self.text, classes="body", markup=False)
        yield Static("", classes="meta", markup=False)

    @property
    def body(self) -> Markdown | Static:
        return self.query_one(".body")

    async def append(self, chunk: str) -> None:
        """Add streamed text; the stream batches updates the screen cannot keep up with."""
        self.text += chunk
        if not self.is_attached:
            return
        body = self.body
        if isinstance(body, Markdown):
            if self._stream is None:
                self._stream = Markdown.get_stream(body)
            await self._stream.write(chunk)
        else:
            body.update(self.text)

    async def finish(self, text: str, meta: str = "") -> None:
        """The reply is complete: show exactly ``text`` and a line about how it ended."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.text = text
        if not self.is_attached:
            return
        body = self.body
        if isinstance(body, Markdown):
            await body.update(text)
        else:
            body.update(text)
        self.set_meta(meta)

    def set_meta(self, meta: str) -> None:
        if not self.is_attached:
            return
        line = self.query_one(".meta", Static)
        line.update(meta)
        line.display = bool(meta)


class ChatLog(VerticalScroll):
    """Scrolls to the newest message as long as the user has not scrolled up."""

    def on_mount(self) -> None:
        self.anchor()

    async def add(self, role: str, text: str = "", label: str | None = None) -> MessageView:
        view = MessageView(role, text, label)
        await self.mount(view)
        view.set_meta("")
        return view

    async def clear(self) -> None:
        await self.remove_children()

    def messages(self) -> list[MessageView]:
        return list(self.query(MessageView))
