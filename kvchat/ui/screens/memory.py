"""The comparison panel, full screen (``/mem``, F3): legible at 80x24."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Static

from kvchat.engine.chat.memory_snapshot import MemorySnapshot
from kvchat.ui.widgets.comparison import ComparisonPanel


class MemoryScreen(Screen[None]):
    BINDINGS = [Binding("escape,f3,q", "app.pop_screen", "Back")]

    def __init__(self, turns: list[MemorySnapshot], live: MemorySnapshot | None) -> None:
        super().__init__()
        self._turns = turns
        self._live = live

    def compose(self) -> ComposeResult:
        yield Static("kvchat · memory comparison", id="memory-title")
        yield ComparisonPanel(id="comparison-full")
        yield Footer()

    def on_mount(self) -> None:
        self.update(self._turns, self._live)

    def update(self, turns: list[MemorySnapshot], live: MemorySnapshot | None) -> None:
        self.query_one(ComparisonPanel).set_data(turns, live)
