"""Keys, slash commands and what the gauge means."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

from kvchat.ui.commands import GAUGE_HELP, help_rows


def help_renderable() -> Group:
    parts: list = []
    for title, rows in help_rows():
        parts.append(Text(title, style="bold underline"))
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", no_wrap=True)
        grid.add_column()
        for key, what in rows:
            grid.add_row(key, what)
        parts += [grid, Text("")]
    parts += [Text("The gauge", style="bold underline"), Text(GAUGE_HELP)]
    return Group(*parts)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box", classes="dialog") as box:
            box.border_title = "kvchat help"
            yield Static(help_renderable(), id="help-text")
        yield Footer(compact=True)
