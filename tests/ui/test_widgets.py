"""Units: text helpers, command parsing, settings parsing, gauge and panel rendering."""

from __future__ import annotations

import pytest
from rich.console import Console

from kvchat.engine.chat.settings import SamplingSettings
from kvchat.ui import commands
from kvchat.ui.format import bar, fmt_bytes, fmt_ratio, sparkline
from kvchat.ui.screens.settings import parse_settings
from kvchat.ui.widgets.comparison import per_turn
from kvchat.ui.widgets.memory_gauge import state_style


def test_bar_fills_in_eighths():
    assert bar(0.0, 4) == ("", "░░░░")
    assert bar(1.0, 4) == ("████", "")
    assert bar(0.5, 4) == ("██", "░░")
    filled, empty = bar(0.24, 10)  # 2.4 cells -> 2 full + 3/8
    assert filled == "██▍" and len(filled + empty) == 10
    assert bar(7.0, 3) == ("███", "")  # over the ceiling: full, never longer


def test_sparkline_shares_a_scale_and_keeps_the_last_values():
    assert sparkline([0, 5, 10], 10, 10) == "▁▅█"
    assert sparkline([5, 5], 10, 10) == "▅▅"  # half of the shared top, not the top
    assert sparkline([1, 2, 3, 4], 4, 2) == "▆█"
    assert sparkline([1, 2], 0, 5) == "▁▁"


def test_formats():
    assert fmt_bytes(None) == "—"
    assert fmt_bytes(64 * 10**6) == "61.0 MiB"  # the CLI's units
    assert fmt_ratio(3, 2) == "1.50x" and fmt_ratio(1, 0) == "—"
    assert state_style(10, None) == "green"
    assert state_style(90, 100) == "yellow"
    assert state_style(101, 100) == "bold red"
    assert per_turn([1.0, 3.0, 3.5]) == [1.0, 2.0, 0.5]


def test_slash_command_parsing():
    assert commands.parse("hello") is None
    assert commands.parse("//etc") is None
    cmd, arg = commands.parse("/model gemma-3-4b")
    assert (cmd.name, arg) == ("model", "gemma-3-4b")
    cmd, arg = commands.parse("/NEW")
    assert (cmd.action, arg) == ("new", "")
    with pytest.raises(ValueError, match="unknown command /nope; try one of /new"):
        commands.parse("/nope")
    names = {c.name for c in commands.SLASH_COMMANDS}
    assert {"new", "resume", "clear", "model", "mem", "help"} <= names


def test_settings_parsing():
    s = parse_settings("  Be brief. ", "0.7", "0.9", "3", "64")
    assert s.system == "Be brief."
    assert s.sampling == SamplingSettings(temperature=0.7, top_p=0.9, seed=3, max_new_tokens=64)
    s = parse_settings("", "", "", "", "")
    assert s.system is None and s.sampling == SamplingSettings()
    with pytest.raises(ValueError, match="top-p must be between 0.01 and 1.0, not 2"):
        parse_settings("", "", "2", "", "")
    with pytest.raises(ValueError, match="max new tokens must be a number, not 'x'"):
        parse_settings("", "", "", "", "x")


def test_help_lists_every_command_and_key():
    console = Console(width=100, record=True)
    from kvchat.ui.screens.help import help_renderable

    console.print(help_renderable())
    text = console.export_text()
    for c in commands.SLASH_COMMANDS:
        assert f"/{c.name}" in text
    for key in ("Shift+Enter, Ctrl+J", "Esc", "Ctrl+P"):
        assert key in text
