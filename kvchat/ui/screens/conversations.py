"""Saved conversations: pick one to resume it from its residual files."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, OptionList, Static
from textual.widgets.option_list import Option

from kvchat.errors import KvchatError
from kvchat.ui.format import count, fmt_bytes


def describe(row: dict[str, Any]) -> Text:
    """Two lines per conversation (three with an error): title and id, then the figures."""
    when = (row.get("last_used") or "")[:16].replace("T", " ")
    text = Text()
    text.append(row.get("title") or "Untitled", style="bold")
    text.append(f"  {row['id']}", style="dim")
    text.append(
        f"\n{row.get('model') or '?'} · {count(row.get('turns', 0), 'turn')} · "
        f"{count(row.get('tokens', 0), 'token')}"
        f" · {fmt_bytes(row.get('bytes_on_disk', 0))} · {when}",
        style="dim",
    )
    origin = row.get("forked_from")
    if origin:
        text.append(f"\n↳ branch of {origin['id']} at turn {origin['turn']}", style="dim italic")
    if row.get("error"):
        text.append(f"\n⚠ {row['error']}", style="red")
    return text


def matches(row: dict[str, Any], query: str) -> bool:
    """Whether a conversation's title, id or any message holds every word of ``query``."""
    haystack = " ".join([row.get("title") or "", row["id"], row.get("text") or ""]).lower()
    return all(word in haystack for word in query.lower().split())


class ConversationsScreen(ModalScreen[str | None]):
    """Lists conversations in a worker (the store may be slow); dismisses with an id."""

    BINDINGS = [
        Binding("escape,f4", "dismiss_none", "Close"),
        Binding("enter", "resume", "Resume", show=True, key_display="⏎"),
        Binding("slash", "search", "Search", show=True, key_display="/"),
    ]

    def __init__(self, list_conversations) -> None:
        super().__init__()
        self._list = list_conversations
        self.rows: list[dict[str, Any]] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="conversations-box", classes="dialog") as box:
            box.border_title = "saved conversations"
            yield Input(placeholder="search titles and messages", id="conversations-search")
            yield Static("reading the conversation store…", id="conversations-status")
            yield OptionList(id="conversations")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one(OptionList).display = False
        self.query_one(Input).display = False
        self.load_rows()

    @on(Input.Changed, "#conversations-search")
    def search(self, event: Input.Changed) -> None:
        self._show(event.value)

    @on(Input.Submitted, "#conversations-search")
    def search_done(self, event: Input.Submitted) -> None:
        options = self.query_one(OptionList)
        if options.option_count:
            options.focus()

    @work(thread=True, exit_on_error=False)
    def load_rows(self) -> None:
        try:
            rows = self._list()
        except KvchatError as exc:
            self.app.call_from_thread(self._failed, str(exc))
            return
        except Exception as exc:  # never a traceback in the terminal
            self.app.call_from_thread(self._failed, f"cannot list conversations: {exc}")
            return
        self.app.call_from_thread(self.show_rows, rows)

    def _failed(self, message: str) -> None:
        self.query_one("#conversations-status", Static).update(message)
        self.notify(message, title="conversations", severity="error")

    def show_rows(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        if not rows:
            self.query_one("#conversations-status", Static).update("No saved conversations yet.")
            return
        self.query_one(Input).display = True
        self._show("")
        self.query_one(OptionList).focus()

    def _show(self, query: str) -> None:
        status = self.query_one("#conversations-status", Static)
        options = self.query_one(OptionList)
        shown = [r for r in self.rows if matches(r, query)] if query.strip() else self.rows
        plural = "s" if len(self.rows) != 1 else ""
        if query.strip():
            status.update(f"{len(shown)} of {len(self.rows)} conversation{plural} match")
        else:
            status.update(
                f"{len(self.rows)} conversation{plural} · ⏎ resumes the highlighted one · "
                "/ searches"
            )
        options.clear_options()
        options.add_options(Option(describe(r), id=r["id"]) for r in shown)
        options.display = bool(shown)
        if shown:
            options.highlighted = 0

    def action_search(self) -> None:
        search = self.query_one(Input)
        if search.display:
            search.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        row = next((r for r in self.rows if r["id"] == event.option.id), {})
        if row.get("error"):
            # The store's own one-line message: what is wrong and how to fix it.
            self.notify(row["error"], title="cannot resume", severity="error", timeout=12)
            return
        self.dismiss(event.option.id)

    def action_resume(self) -> None:
        options = self.query_one(OptionList)
        if options.highlighted is not None:
            options.action_select()

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
