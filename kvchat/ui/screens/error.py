"""A modal for errors that leave the app unable to chat (the model did not load)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Static


class ErrorScreen(ModalScreen[str]):
    """Shows one error message as it is (the CLI's wording). Dismisses with the button id."""

    BINDINGS = [Binding("escape", "dismiss('close')", "Close")]

    def __init__(self, title: str, message: str) -> None:
        super().__init__()
        self.title_text = title
        self.message = message

    def compose(self) -> ComposeResult:
        with Vertical(id="error-box", classes="dialog") as box:
            box.border_title = self.title_text
            yield Static(self.message, id="error-message", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Close", id="close", variant="primary", compact=True)
                yield Button("Quit", id="quit", variant="error", compact=True)
        yield Footer(compact=True)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id)
