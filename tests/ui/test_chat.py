"""Pilot tests of the chat on the fake engine: startup, sending, streaming, stopping, errors."""

from __future__ import annotations

import time

import pytest
from textual.widgets import Markdown

from kvchat.ui.screens.error import ErrorScreen
from kvchat.ui.screens.memory import MemoryScreen
from kvchat.ui.widgets.comparison import ComparisonPanel
from tests.ui.fakes import REPLY
from tests.ui.helpers import ready, record_notifications, send, texts, wait_until

pytestmark = pytest.mark.anyio

LONG_REPLY = " ".join(f"word{i}" for i in range(200))


async def test_window_appears_at_once_and_model_loads_in_background(make_app):
    app = make_app(hold_load=True)
    async with app.run_test() as pilot:
        # Mounted and drawn while the engine is still loading.
        assert app.phase == "loading"
        assert app.query_one("#load-progress").display
        status = str(app.query_one("#status-text").render())
        assert "loading" in status
        app.backend.load_gate.set()
        await ready(pilot)
        assert not app.query_one("#load-progress").display
        assert "ready" in str(app.query_one("#status-text").render())
        assert app.backend.threads == {"kvchat-engine"}
        assert app.gauge.weights == 513 * 1024 * 1024


async def test_enter_sends_and_the_reply_streams(make_app):
    app = make_app(delay=0.05)
    async with app.run_test() as pilot:
        await ready(pilot)
        app.prompt.load_text("Hello there")
        await pilot.press("enter")
        assert app.prompt.text == ""
        # Partway: busy, part of the reply on screen, the stop key in the footer.
        await wait_until(pilot, lambda: app._reply is not None and len(app._reply.text) > 10)
        assert app.busy
        assert app.check_action("stop", ())
        partial = app._reply.text
        assert REPLY.startswith(partial) and partial != REPLY
        await wait_until(pilot, lambda: not app.busy)
        assert texts(app)[-2:] == [("user", "Hello there"), ("assistant", REPLY)]
        reply_view = app.chat_log.messages()[-1]
        assert reply_view.query_one(Markdown).source == REPLY
        assert app.backend.sent[0][0] == "Hello there"
        assert len(app.turn_memory) == 1
        assert app.gauge.memory.tokens == app.backend.tokens
        assert not app.check_action("stop", ())
        assert app.backend.threads == {"kvchat-engine"}


async def test_shift_enter_and_ctrl_j_add_newlines(make_app):
    app = make_app()
    async with app.run_test() as pilot:
        await ready(pilot)
        await pilot.press("a", "shift+enter", "b", "ctrl+j", "c")
        assert app.prompt.text == "a\nb\nc"
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.backend.sent and not app.busy)
        assert app.backend.sent[0][0] == "a\nb\nc"
        # Up in the empty box recalls it.
        await pilot.press("up")
        assert app.prompt.text == "a\nb\nc"


@pytest.mark.parametrize(
    ("delay", "words"),
    [(0.02, 100), (0.15, 16)],  # ~2 s of streaming: fast tokens, then tokens 0.15 s apart
    ids=["fast tokens", "slow tokens"],
)
async def test_gauge_updates_at_least_four_times_a_second_while_streaming(make_app, delay, words):
    app = make_app(delay=delay, reply=" ".join(LONG_REPLY.split(" ")[:words]))
    async with app.run_test() as pilot:
        await ready(pilot)
        before = app.gauge.updates
        app.prompt.load_text("go")
        start = time.monotonic()
        await pilot.press("enter")
        await wait_until(pilot, lambda: not app.busy, timeout=20)
        elapsed = time.monotonic() - start
        during = app.gauge.updates - before - 1  # minus the snapshot at the end of the turn
        # elapsed also covers the turn's start and end around the stream (first chunk, final
        # render): one reading's worth of slack at each end keeps a busy CI from failing it.
        assert (during + 2) / elapsed >= 4, (during, elapsed)
        assert app.gauge.memory.tokens == app.backend.tokens


async def test_esc_stops_the_reply_and_keeps_what_was_said(make_app):
    app = make_app(delay=0.03, reply=LONG_REPLY)
    async with app.run_test() as pilot:
        await ready(pilot)
        app.prompt.load_text("talk for a while")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app._reply is not None and len(app._reply.text) > 20)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not app.busy)
        assert app.backend.stopped
        role, said = texts(app)[-1]
        assert role == "assistant" and said and LONG_REPLY.startswith(said) and said != LONG_REPLY
        assert "stopped" in str(app.chat_log.messages()[-1].query_one(".meta").render())
        assert len(app.turn_memory) == 1
        # The conversation goes on.
        app.backend.reply = "fine"
        await send(pilot, "again")
        assert texts(app)[-1] == ("assistant", "fine")


async def test_send_error_is_a_notification_with_the_engine_message(make_app):
    message = (
        "the standard cache needs 2.0 MiB for 90 tokens, over --max-mem 1.0 MiB; "
        "use --cache kvdirect or raise --max-mem"
    )
    app = make_app(send_error=message)
    async with app.run_test() as pilot:
        await ready(pilot)
        seen = record_notifications(app)
        app.prompt.load_text("hi")
        await pilot.press("enter")
        await wait_until(pilot, lambda: seen)
        assert seen == [(message, "error")]
        assert not app.busy
        assert texts(app)[-1] == ("user", "hi")  # no empty reply left behind
        assert app.is_running


async def test_load_error_is_a_modal_and_another_model_can_be_loaded(make_app):
    message = "unknown model 'nope'; use an alias from `kvchat models`, a repo id or a directory"
    app = make_app(load_error=message)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, ErrorScreen))
        await pilot.pause()
        assert str(app.screen.query_one("#error-message").render()) == message
        assert app.phase == "failed"
        await pilot.press("escape")
        seen = record_notifications(app)
        app.prompt.load_text("hello?")
        await pilot.press("enter")
        assert seen and seen[-1][1] == "error" and "/model NAME" in seen[-1][0]
        assert app.prompt.text == "hello?"  # kept for later
        app.backend.load_error = None
        app.prompt.load_text("/model smollm2-360m")
        await pilot.press("enter")
        await ready(pilot)
        assert app.model.name == "smollm2-360m"


async def test_load_error_modal_quit_button_exits(make_app):
    app = make_app(load_error="model files are corrupted; delete the cache and retry")
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, ErrorScreen))
        await pilot.pause()
        await pilot.click("#quit")
        await pilot.pause()
        assert not app.is_running


async def test_enter_while_loading_warns_and_keeps_the_message(make_app):
    app = make_app(hold_load=True)
    async with app.run_test() as pilot:
        seen = record_notifications(app)
        app.prompt.load_text("early bird")
        await pilot.press("enter")
        assert seen[-1][1] == "warning" and "still loading" in seen[-1][0]
        assert app.prompt.text == "early bird"
        assert app.backend.sent == []
        app.backend.load_gate.set()


async def test_comparison_follows_the_stream_live(make_app):
    app = make_app(delay=0.02, reply="Short.")
    async with app.run_test() as pilot:
        await ready(pilot)
        await send(pilot, "first")
        app.backend.reply = LONG_REPLY[: len(LONG_REPLY) // 2]
        app.prompt.load_text("second")
        app.prompt.action_submit()  # (pilot.press waits for a quiet queue: not while streaming)
        await wait_until(pilot, lambda: app.busy)
        app.action_memory()
        await pilot.pause(0)
        screen = app.screen
        assert isinstance(screen, MemoryScreen)
        panel = screen.query_one(ComparisonPanel)
        await wait_until(pilot, lambda: panel.live is not None)
        live_tokens = panel.live.tokens
        assert live_tokens > panel.turns[-1].tokens
        await wait_until(pilot, lambda: not app.busy)
        await pilot.pause()
        assert panel.live is None and len(panel.turns) == 2
        assert panel.turns[-1].tokens >= live_tokens


async def test_side_panel_only_on_wide_terminals(make_app):
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        assert not app.side_panel.display
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await ready(pilot)
        assert app.side_panel.display
        await send(pilot, "hi")
        assert app.side_panel.turns == app.turn_memory
