"""Per-conversation settings: system prompt and sampling.

``ChatSettings`` is what the app keeps for the current conversation; ``/new`` starts again
from the launch defaults. The screen dismisses with new settings, or None when cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Input, Label, Static, TextArea

from kvchat.engine.chat.settings import SamplingSettings


@dataclass
class ChatSettings:
    system: str | None = None
    sampling: SamplingSettings = field(default_factory=SamplingSettings)

    def copy(self) -> ChatSettings:
        return ChatSettings(self.system, replace(self.sampling))


def _number(text: str, name: str, kind: type, low: float, high: float | None = None):
    text = text.strip()
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, not {text!r}") from None
    if value != value or value < low or (high is not None and value > high):  # nan too
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{name} must be {bound}, not {text}")
    return value


def parse_settings(
    system: str, temperature: str, top_p: str, seed: str, max_new: str
) -> ChatSettings:
    """The form's text -> settings; ValueError with a one-line message on bad input."""
    sampling = SamplingSettings(
        temperature=_number(temperature, "temperature", float, 0.0, 5.0)
        if temperature.strip()
        else None,
        top_p=_number(top_p, "top-p", float, 0.01, 1.0) if top_p.strip() else 1.0,
        seed=_number(seed, "seed", int, 0) if seed.strip() else None,
        max_new_tokens=_number(max_new, "max new tokens", int, 1, 32768)
        if max_new.strip()
        else 256,
    )
    return ChatSettings(system.strip() or None, sampling)


class SettingsScreen(ModalScreen[ChatSettings | None]):
    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+s", "save", "Save"),
    ]

    def __init__(self, current: ChatSettings) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        s = self.current.sampling
        with Vertical(id="settings-box", classes="dialog") as box:
            box.border_title = "settings for this conversation"
            yield Label("System prompt")
            yield TextArea(self.current.system or "", id="system", soft_wrap=True)
            with Grid(id="sampling"):
                yield Label("Temperature")
                yield Input(
                    "" if s.temperature is None else str(s.temperature),
                    placeholder="greedy",
                    id="temperature",
                    compact=True,
                )
                yield Label("Top-p")
                yield Input(str(s.top_p), id="top_p", compact=True)
                yield Label("Seed")
                yield Input(
                    "" if s.seed is None else str(s.seed),
                    placeholder="random",
                    id="seed",
                    compact=True,
                )
                yield Label("Max new tokens")
                yield Input(str(s.max_new_tokens), id="max_new", compact=True)
            yield Static("A new system prompt applies from the next message.", classes="hint")
            with Horizontal(classes="buttons"):
                yield Button("Save", id="save", variant="primary", compact=True)
                yield Button("Cancel", id="cancel", compact=True)
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#system", TextArea).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()

    def on_input_submitted(self) -> None:
        self.action_save()

    def action_save(self) -> None:
        try:
            settings = parse_settings(
                self.query_one("#system", TextArea).text,
                *(
                    self.query_one(f"#{i}", Input).value
                    for i in ("temperature", "top_p", "seed", "max_new")
                ),
            )
        except ValueError as exc:
            self.notify(str(exc), title="settings", severity="error")
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        self.dismiss(None)
