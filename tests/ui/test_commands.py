"""Slash commands, the command palette, the footer keys and the settings screen."""

from __future__ import annotations

import pytest
from textual.widgets import Input, TextArea

from kvchat.ui.screens.help import HelpScreen
from kvchat.ui.screens.memory import MemoryScreen
from kvchat.ui.screens.settings import SettingsScreen
from kvchat.ui.widgets.comparison import ComparisonPanel
from tests.ui.helpers import ready, record_notifications, send, texts, wait_until

pytestmark = pytest.mark.anyio


async def command(pilot, text: str) -> None:
    pilot.app.prompt.load_text(text)
    await pilot.press("enter")
    await pilot.pause()


async def test_help(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        await command(pilot, "/help")
        assert isinstance(app.screen, HelpScreen)
        assert app.prompt.text == ""
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)


async def test_new_starts_an_empty_conversation(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        await send(pilot, "first")
        await command(pilot, "/new")
        await wait_until(pilot, lambda: app.backend.new_count == 1 and not app.turn_memory)
        await pilot.pause()
        assert texts(app) == [("note", "new conversation")]
        assert app.gauge.memory.tokens == 0
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.backend.new_count == 2)


async def test_clear_empties_the_screen_but_keeps_the_conversation(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        await send(pilot, "first")
        await command(pilot, "/clear")
        assert texts(app) == []
        assert len(app.turn_memory) == 1
        assert app.backend.new_count == 0


async def test_model_shows_what_is_loaded(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        await command(pilot, "/model")
        role, text = texts(app)[-1]
        assert role == "note"
        assert "smollm2-135m" in text and "float32 on cpu" in text and "max-mem 61.0 MiB" in text


async def test_model_name_loads_another_model(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        await send(pilot, "first")
        app.backend.load_gate.clear()
        await command(pilot, "/model gemma-3-270m")
        assert app.phase == "loading"
        app.backend.load_gate.set()
        await ready(pilot)
        assert app.model.name == "gemma-3-270m"
        assert app.turn_memory == []


async def test_mem_opens_the_comparison(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        await send(pilot, "one")
        await send(pilot, "two")
        await command(pilot, "/mem")
        assert isinstance(app.screen, MemoryScreen)
        panel = app.screen.query_one(ComparisonPanel)
        assert [t.tokens for t in panel.turns] == [t.tokens for t in app.turn_memory]
        await pilot.press("escape")
        await pilot.press("f3")
        assert isinstance(app.screen, MemoryScreen)


async def test_system_prompt_reaches_the_engine_with_the_next_message(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        await command(pilot, "/system Answer in one word.")
        assert app.settings.system == "Answer in one word."
        await send(pilot, "hi")
        assert app.backend.systems == ["Answer in one word."]
        await send(pilot, "again")
        assert app.backend.systems == ["Answer in one word."]  # only when it changes


async def test_unknown_command_is_an_error_and_double_slash_is_sent(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        seen = record_notifications(app)
        await command(pilot, "/frobnicate")
        assert seen[-1][1] == "error" and "unknown command /frobnicate" in seen[-1][0]
        assert app.prompt.text == "/frobnicate"
        await send(pilot, "//etc/hosts is a file")
        assert app.backend.sent[-1][0] == "/etc/hosts is a file"


async def test_quit_command(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        await command(pilot, "/quit")
        assert not app.is_running


async def test_settings_screen_sets_sampling_for_the_conversation(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        seen = record_notifications(app)
        await pilot.press("f2")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#temperature", Input).value = "hot"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        assert seen[-1] == ("temperature must be a number, not 'hot'", "error")
        app.screen.query_one("#system", TextArea).load_text("Be brief.")
        app.screen.query_one("#temperature", Input).value = "0.7"
        app.screen.query_one("#seed", Input).value = "7"
        app.screen.query_one("#max_new", Input).value = "32"
        await pilot.press("ctrl+s")
        assert not isinstance(app.screen, SettingsScreen)
        await send(pilot, "hi")
        sampling = app.backend.sent[-1][1]
        assert (sampling.temperature, sampling.seed, sampling.max_new_tokens) == (0.7, 7, 32)
        assert app.backend.systems == ["Be brief."]
        # /new goes back to the launch defaults.
        await command(pilot, "/new")
        await wait_until(pilot, lambda: app.backend.new_count == 1)
        await pilot.pause()
        assert app.settings.system is None and app.settings.sampling.temperature is None


async def test_settings_cancel_changes_nothing(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        await command(pilot, "/settings")
        app.screen.query_one("#temperature", Input).value = "1.5"
        await pilot.press("escape")
        assert app.settings.sampling.temperature is None


async def test_command_palette_has_the_app_commands(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for title in ("New conversation", "Resume a conversation", "Memory comparison",
                      "Settings", "Model", "Clear screen", "Help"):  # fmt: skip
            assert title in titles
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Memory comparison")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, MemoryScreen))


async def test_footer_shows_the_keys_and_stop_only_while_replying(make_app):
    app = make_app(delay=0.05)
    async with app.run_test() as pilot:
        await ready(pilot)

        def shown() -> set[str]:
            return {
                b.binding.key
                for b in app.screen.active_bindings.values()
                if b.binding.show and b.enabled and app.check_action(b.binding.action, ())
            }

        assert {"enter", "f1", "f2", "f3", "f4", "ctrl+q"} <= shown()
        assert "escape" not in shown()
        app.prompt.load_text("hi")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.busy)
        assert "escape" in shown()
        await wait_until(pilot, lambda: not app.busy)


async def test_commands_that_would_drop_a_streaming_reply_wait(make_app):
    app = make_app(delay=0.05)
    async with app.run_test() as pilot:
        await ready(pilot)
        seen = record_notifications(app)
        app.prompt.load_text("hi")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.busy)
        for text in ("/clear", "/new", "/resume x", "/model other"):
            await command(pilot, text)
            assert seen[-1][1] == "warning" and "esc" in seen[-1][0], text
        assert app.busy and app.backend.new_count == 0
        await wait_until(pilot, lambda: not app.busy)
        assert texts(app)[-1][0] == "assistant"
