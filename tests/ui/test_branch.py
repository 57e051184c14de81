"""Regenerate, edit, copy and search in the app, driven with Pilot on the fake engine."""

from __future__ import annotations

import pytest

from kvchat.ui.screens.conversations import ConversationsScreen
from tests.ui.fakes import SAMPLE_CONVERSATIONS
from tests.ui.helpers import ready, record_notifications, send, texts, wait_until

pytestmark = pytest.mark.anyio


async def branched_reply(pilot, before: int) -> None:
    app = pilot.app
    await wait_until(pilot, lambda: not app.busy and len(app.backend.sent) > before)
    await pilot.pause()


@pytest.mark.parametrize("how", ["key", "command"])
async def test_regenerate_answers_the_last_message_again_in_a_branch(make_app, how):
    app = make_app(reply="Paris is the capital.")
    async with app.run_test() as pilot:
        await ready(pilot)
        await send(pilot, "What is the capital of France?")
        await send(pilot, "And of Italy?")
        sent = len(app.backend.sent)
        if how == "key":
            await pilot.press("ctrl+r")
        else:
            app.prompt.load_text("/regenerate")
            await pilot.press("enter")
        await branched_reply(pilot, sent)
        assert app.backend.branched == [2]
        text, sampling = app.backend.sent[-1]
        assert text == "And of Italy?" and sampling.temperature == 0.7  # greedy would repeat
        log = texts(app)
        assert [t for r, t in log if r == "user"] == [
            "What is the capital of France?",
            "And of Italy?",
        ]
        assert any(r == "note" and "regenerated: a branch of parent-id" in t for r, t in log)
        assert log[-1] == ("assistant", "Paris is the capital.")


async def test_editing_an_earlier_message_branches_before_it(make_app):
    app = make_app(reply="An answer.")
    async with app.run_test() as pilot:
        await ready(pilot)
        for question in ("first", "second", "third"):
            await send(pilot, question)
        await pilot.press("ctrl+b")
        assert app.editing == 3 and app.prompt.text == "third"
        await pilot.press("ctrl+b")
        assert app.editing == 2 and app.prompt.text == "second"
        users = [m for m in app.chat_log.messages() if m.role == "user"]
        assert users[1].has_class("editing") and not users[2].has_class("editing")
        app.prompt.load_text("second, edited")
        sent = len(app.backend.sent)
        await pilot.press("enter")
        await branched_reply(pilot, sent)
        assert app.backend.branched == [2] and app.editing is None
        assert app.backend.sent[-1][0] == "second, edited"
        assert app.backend.sent[-1][1].temperature is None  # an edit keeps your sampling
        assert [t for r, t in texts(app) if r == "user"] == ["first", "second, edited"]


async def test_esc_cancels_an_edit_and_nothing_is_branched(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        await pilot.press("ctrl+b")
        assert app.editing == 1
        await pilot.press("escape")
        assert app.editing is None and app.prompt.text == ""
        assert not [m for m in app.chat_log.messages() if m.has_class("editing")]
        await send(pilot, "goes on")
        assert app.backend.branched == []


async def test_nothing_to_regenerate_or_edit_is_a_warning(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        seen = record_notifications(app)
        await pilot.press("ctrl+r")
        await pilot.press("ctrl+b")
        assert [s for _, s in seen] == ["warning", "warning"]
        assert "nothing to regenerate yet" in seen[0][0] and app.backend.branched == []


async def test_a_branch_that_fails_says_why_and_keeps_the_chat(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        app.backend.branch_error = "the last turn is not saved yet; once a save succeeds ..."
        seen = record_notifications(app)
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: seen and not app.busy)
        assert seen[-1][1] == "error" and "not saved yet" in seen[-1][0]
        assert [t for r, t in texts(app) if r == "user"] == ["hello"]


async def test_copy_puts_the_last_reply_or_its_code_block_on_the_clipboard(make_app):
    reply = "Use this:\n\n```python\nprint('hi')\n```\n\nor that."
    app = make_app(reply=reply)
    async with app.run_test() as pilot:
        await ready(pilot)
        await send(pilot, "how do I print?")
        await pilot.press("f5")
        assert app.clipboard == reply
        app.prompt.load_text("/copy code")
        await pilot.press("enter")
        await pilot.pause()
        assert app.clipboard == "print('hi')"


async def test_f4_searches_titles_and_messages_and_shows_where_a_branch_came_from(make_app):
    rows = [
        {**SAMPLE_CONVERSATIONS[0], "text": "what is the capital of france?\nparis."},
        {
            **SAMPLE_CONVERSATIONS[0],
            "id": "20261201-090000-f0f0",
            "title": "Rivers",
            "text": "how long is the nile?",
            "forked_from": {"id": "20261130-120000-abcd", "turn": 1},
        },
    ]
    app = make_app(conversations=rows)
    async with app.run_test() as pilot:
        await ready(pilot)
        await pilot.press("f4")
        await wait_until(
            pilot, lambda: isinstance(app.screen, ConversationsScreen) and app.screen.rows
        )
        screen = app.screen
        options = screen.query_one("#conversations")
        assert options.option_count == 2
        assert "branch of 20261130-120000-abcd at turn 1" in str(
            options.get_option_at_index(1).prompt
        )
        await pilot.press("slash")
        await pilot.press(*"nile")
        await pilot.pause()
        assert options.option_count == 1 and options.get_option_at_index(0).id == rows[1]["id"]
        await pilot.press("enter")  # to the list, then resume it
        await pilot.press("enter")
        await wait_until(pilot, lambda: not isinstance(app.screen, ConversationsScreen))
