"""Snapshots of the main screen and the comparison panel at 80x24 and 160x48.

Deterministic: the fake engine's figures depend on token counts only, RSS is a fixed number,
tokens per second are canned, the cursor does not blink. Update with
``pytest tests/ui/test_snapshots.py --snapshot-update`` and look at the SVGs before committing.
"""

from __future__ import annotations

import pytest

from kvchat.ui.app import KvchatApp
from tests.ui.fakes import FakeBackend
from tests.ui.helpers import chat_log_settled, ready, send

SIZES = [(80, 24), (160, 48)]
MARKDOWN_REPLY = (
    "The capital of France is **Paris**.\n\n"
    "- about 2.1 million people\n"
    "- on the Seine\n\n"
    "Ask me about `another` city."
)


def app_for_snapshot() -> KvchatApp:
    return KvchatApp(FakeBackend(reply=MARKDOWN_REPLY))


async def _chat(pilot, turns: int) -> None:
    await ready(pilot)
    pilot.app.prompt.cursor_blink = False
    questions = ["What is the capital of France?", "And how many people live there?"]
    for i in range(turns):
        await send(pilot, questions[i % 2] if i < 2 else f"Question number {i + 1}?")
    await chat_log_settled(pilot)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_main_screen(snap_compare, size):
    async def run_before(pilot) -> None:
        await _chat(pilot, 2)

    assert snap_compare(app_for_snapshot(), terminal_size=size, run_before=run_before)


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_comparison_panel(snap_compare, size):
    async def run_before(pilot) -> None:
        await _chat(pilot, 6)
        await pilot.press("f3")
        await pilot.pause()

    assert snap_compare(app_for_snapshot(), terminal_size=size, run_before=run_before)


def test_not_saved_notice_at_80x24(snap_compare):
    """A turn the store could not save: the notice sits above the gauge, clear of the box."""
    disk_full = "saving turn 1 failed (No space left on device); free some disk space and try again"

    async def run_before(pilot) -> None:
        await _chat(pilot, 1)

    app = KvchatApp(FakeBackend(reply=MARKDOWN_REPLY, save_error=disk_full))
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_editing_an_earlier_message_at_80x24(snap_compare):
    """ctrl+b twice: the message being edited is marked, its text is in the box."""

    async def run_before(pilot) -> None:
        await _chat(pilot, 2)
        await pilot.press("ctrl+b", "ctrl+b")
        await pilot.pause()

    assert snap_compare(app_for_snapshot(), terminal_size=(80, 24), run_before=run_before)


def test_saved_conversations_searched_at_80x24(snap_compare):
    """F4 with a search typed: the matching branch, and where it came from."""
    from tests.ui.fakes import SAMPLE_CONVERSATIONS

    rows = [
        {**SAMPLE_CONVERSATIONS[0], "text": "what is the capital of france?"},
        {
            **SAMPLE_CONVERSATIONS[0],
            "id": "20261201-090000-f0f0",
            "title": "Capital cities, edited",
            "text": "what is the capital of italy?",
            "forked_from": {"id": "20261130-120000-abcd", "turn": 1},
        },
    ]

    async def run_before(pilot) -> None:
        from kvchat.ui.screens.conversations import ConversationsScreen
        from tests.ui.helpers import wait_until

        await ready(pilot)
        await pilot.press("f4")
        screen = lambda: pilot.app.screen  # noqa: E731
        await wait_until(pilot, lambda: isinstance(screen(), ConversationsScreen) and screen().rows)
        await pilot.press("slash", *"italy")
        await wait_until(pilot, lambda: screen().query_one("#conversations").option_count == 1)
        await pilot.pause()

    app = KvchatApp(FakeBackend(reply=MARKDOWN_REPLY, conversations=rows))
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)
