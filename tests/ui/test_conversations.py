"""Saved conversations: the list, resuming one, and the errors on the way."""

from __future__ import annotations

import pytest
from textual.widgets import OptionList

from kvchat.ui.screens.conversations import ConversationsScreen
from tests.ui.fakes import CORRUPTED
from tests.ui.fakes import SAMPLE_CONVERSATIONS as ROWS
from tests.ui.fakes import SAMPLE_SAVED as SAVED
from tests.ui.helpers import ready, record_notifications, send, texts, wait_until

pytestmark = pytest.mark.anyio


async def test_list_and_resume_shows_the_history(make_app):
    app = make_app(conversations=ROWS, saved=SAVED)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.press("f4")
        await wait_until(pilot, lambda: isinstance(app.screen, ConversationsScreen))
        screen = app.screen
        await wait_until(pilot, lambda: screen.query_one(OptionList).option_count == 2)
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.turn_memory) == 2)
        await pilot.pause()
        assert texts(app) == [
            ("note", "resumed Capital cities"),
            ("user", "What is the capital of France?"),
            ("assistant", "The capital of France is Paris."),
            ("user", "And of Italy?"),
            ("assistant", "Rome."),
        ]
        assert app.settings.system == "Be brief."
        assert app.gauge.memory.tokens == 120
        # The conversation continues from there.
        await send(pilot, "And of Spain?")
        assert len(app.turn_memory) == 3
        assert app.backend.systems == []  # the resumed prompt is already the engine's


async def test_a_conversation_that_cannot_be_opened_shows_the_store_message(make_app):
    app = make_app(conversations=ROWS, saved=SAVED)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        seen = record_notifications(app)
        await pilot.press("f4")
        await wait_until(pilot, lambda: isinstance(app.screen, ConversationsScreen))
        screen = app.screen
        await wait_until(pilot, lambda: screen.query_one(OptionList).option_count == 2)
        await pilot.press("down", "enter")
        await pilot.pause()
        assert (CORRUPTED, "error") in seen
        assert app.screen is screen  # still listed, nothing opened
        await pilot.press("escape")
        assert not isinstance(app.screen, ConversationsScreen)


async def test_resume_by_id_and_engine_errors(make_app):
    app = make_app(saved=SAVED)
    async with app.run_test() as pilot:
        await ready(pilot)
        seen = record_notifications(app)
        app.prompt.load_text("/resume 20261130-120000-abcd")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.turn_memory) == 2)
        app.prompt.load_text("/resume nope")
        await pilot.press("enter")
        await wait_until(pilot, lambda: seen)
        assert seen[-1] == ("no conversation 'nope'; `kvchat list` shows the ids", "error")
        assert len(app.turn_memory) == 2  # the open conversation is untouched


async def test_empty_store(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        app.prompt.load_text("/resume")
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, ConversationsScreen))
        status = app.screen.query_one("#conversations-status")
        await wait_until(pilot, lambda: "No saved" in str(status.render()))
