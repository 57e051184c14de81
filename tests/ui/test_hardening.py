"""What the app shows when things go wrong or the terminal is small: turns that are not
saved, a failed /model, 80 columns, singular counts, toasts clear of the message box."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import pytest
from textual.widgets._toast import ToastRack

from kvchat.ui.app import KvchatApp
from kvchat.ui.backend import ModelView
from kvchat.ui.engine_backend import EngineBackend
from kvchat.ui.widgets.memory_gauge import MemoryGauge
from tests.ui.fakes import MIB, fake_memory
from tests.ui.helpers import ready, send, wait_until

pytestmark = pytest.mark.anyio

DISK_FULL = "saving turn 1 failed (No space left on device); free some disk space and try again"


async def test_turns_that_are_not_saved_get_a_notice_until_a_save_works(make_app):
    app = make_app(save_error=DISK_FULL)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        assert not app.save_notice.display
        await send(pilot, "Hello")
        await send(pilot, "Again")
        notice = str(app.save_notice.render())
        assert app.save_notice.display and app.unsaved_turns == [1, 2]
        assert "turns 1-2 are not saved" in notice and "No space left on device" in notice
        assert "free some disk space" in notice and "next message saves them" in notice
        assert "not saved" in app.chat_log.messages()[-1].query_one(".meta").render().plain
        await pilot.pause(0.5)
        assert app.save_notice.display  # persistent, not a toast that times out
        app.backend.save_error = None  # the disk has room again: the next save writes all
        await send(pilot, "Third")
        assert not app.save_notice.display and app.unsaved_turns == []


@pytest.mark.slow
async def test_a_data_dir_that_cannot_be_created_is_shown_with_the_real_engine(
    smollm2_dir, tmp_path
):
    a_file = tmp_path / "a-file"
    a_file.write_text("a regular file: nothing can be created under it")
    opts = {
        "model": str(smollm2_dir), "device": "cpu", "dtype": "float32", "weights": "none",
        "cache_kind": "kvdirect", "max_mem": None, "hot_window": None,
        "checkpoint": "residual", "prefill_chunk": 256, "system": None,
        "data_dir": str(a_file / "data"),
    }  # fmt: skip
    app = KvchatApp(EngineBackend(opts))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: app.phase != "loading", timeout=180)
        assert app.phase == "ready", app.load_error
        app.settings.sampling.max_new_tokens = 4
        await send(pilot, "Hi", timeout=120)
        notice = str(app.save_notice.render())
        assert app.save_notice.display and "turn 1 is not saved" in notice
        assert "Not a directory" in notice
    app.backend.close()


async def test_a_failed_model_switch_clears_the_old_figures(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await send(pilot, "Hello")
        assert "513.0 MiB" in _gauge_text(app)
        app.backend.load_error = "model 'nope' is not found locally"
        await app.action_model("nope")
        await wait_until(pilot, lambda: app.phase == "failed")
        await pilot.press("escape")  # the error dialog
        await pilot.pause()
        text = _gauge_text(app)
        assert "513.0 MiB" not in text and "0 tokens" in text


async def test_status_line_fits_80_columns_while_replying(make_app):
    app = make_app(max_mem=976_562 * 1024 // 1000, delay=0.05)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        app.model = ModelView("smollm2-135m", "float32", "cpu", 513 * MIB, True)
        app.prompt.load_text("Hello")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.busy)
        line = str(app.status_text.render())
        assert len(line) <= 80 and line.rstrip().endswith("976.6 KiB") and "…" not in line
        assert "replying" in line and "max-mem" in line
        await wait_until(pilot, lambda: not app.busy)


async def test_toasts_stay_clear_of_the_message_box(make_app):
    app = make_app()
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await ready(pilot)
        app.notify("a note that would cover the box", timeout=10)
        await pilot.pause(0.3)
        rack = app.screen.get_child_by_type(ToastRack)
        toasts = [t.region for t in rack.walk_children() if type(t).__name__ == "Toast"]
        assert toasts
        for region in toasts:
            assert not region.overlaps(app.prompt.region)
            assert not region.overlaps(app.gauge.region)


@pytest.mark.parametrize("width", [80, 100, 160])
async def test_gauge_readings_never_run_together(width):
    from textual.app import App

    class One(App):
        def compose(self):
            yield MemoryGauge(ceiling=1_000_000)

    app = One()
    async with app.run_test(size=(width, 6)) as pilot:
        gauge = app.query_one(MemoryGauge)
        memory = dataclasses.replace(
            fake_memory(40, 1_000_000), state_bytes=814_080, weights_bytes=538_000_000
        )
        gauge.show(memory)
        await pilot.pause()
        first = gauge.render().renderables[0].plain
        assert "795.0 KiB / 976.6 KiB" in first
        if "weights" in first:
            gap = first.split("976.6 KiB", 1)[1].split("weights", 1)[0]
            assert len(gap) >= 3, first


def test_counts_are_singular_for_one():
    from kvchat.ui.format import count

    assert count(1, "token") == "1 token" and count(2, "turn") == "2 turns"
    assert count(0, "token") == "0 tokens"


async def test_one_token_reads_singular(make_app):
    app = make_app(reply="Yes")
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await send(pilot, "Ok?")
        meta = app.chat_log.messages()[-1].query_one(".meta").render().plain
        assert meta.startswith("1 token ·")


def _gauge_text(app) -> str:
    return "\n".join(line.plain for line in app.gauge.render().renderables)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
async def test_termination_quits_cleanly_and_closes_the_session(make_app, signum):
    app = make_app()
    app.handle_signals = True  # as run_app does
    closed: list[str] = []
    app.backend.close = lambda: closed.append(threading.current_thread().name)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        os.kill(os.getpid(), signum)
        await pilot.pause(0.3)
    app.wait_for_engine(5)
    assert app.return_code == 128 + signum
    assert closed == ["kvchat-engine"]  # closed on the engine thread, after its last job


def test_settings_refuse_a_temperature_that_is_not_a_number():
    from kvchat.ui.screens.settings import parse_settings

    with pytest.raises(ValueError, match="temperature must be between"):
        parse_settings("", "nan", "", "", "64")


async def test_a_long_prompt_being_read_shows_in_the_status_line(make_app):
    from kvchat.ui.messages import PrefillProgress

    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        app.busy = True  # as while a reply is on its way
        app.on_prefill_progress(PrefillProgress(1024, 4096))
        assert "reading the prompt 25%" in str(app.status_text.render())
        app.on_prefill_progress(PrefillProgress(4096, 4096))  # read: back to "replying"
        assert "reading the prompt" not in str(app.status_text.render())
        app.on_prefill_progress(PrefillProgress(100, 400))  # short prompts show nothing
        assert "reading the prompt" not in str(app.status_text.render())
        app.busy = False
