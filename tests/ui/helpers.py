"""Waiting helpers for Pilot tests (the app works on another thread)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from textual.pilot import Pilot


async def wait_until(pilot: Pilot, condition: Callable[[], object], timeout: float = 5.0) -> None:
    """Let the app run until ``condition()`` is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {condition}")
        await pilot.pause(0.02)
        await asyncio.sleep(0)


async def ready(pilot: Pilot, timeout: float = 5.0) -> None:
    await wait_until(pilot, lambda: pilot.app.phase == "ready", timeout)
    await pilot.pause()


async def send(pilot: Pilot, text: str, timeout: float = 5.0) -> None:
    """Type ``text`` in the message box, press Enter, wait for the reply to finish."""
    app = pilot.app
    before = len(app.turn_memory)
    app.prompt.focus()
    app.prompt.load_text(text)
    await pilot.press("enter")
    await wait_until(pilot, lambda: not app.busy and len(app.turn_memory) > before, timeout)
    await pilot.pause()


async def chat_log_settled(pilot: Pilot, frames: int = 3, timeout: float = 5.0) -> None:
    """Let the app run until the chat log is scrolled to its end (where it scrolls at all)
    and its scroll and size have held for ``frames`` frames: on a loaded machine a snapshot
    taken one frame early catches the log between a reply's layout and its scroll to the
    end."""
    log = pilot.app.chat_log
    seen: list[object] = []

    def at_rest() -> bool:
        recent = seen[-frames:]
        at_end = log.max_scroll_y <= 0 or log.scroll_y == log.max_scroll_y
        return len(recent) == frames and len(set(recent)) == 1 and at_end

    deadline = time.monotonic() + timeout
    while not at_rest():
        if time.monotonic() > deadline:
            raise AssertionError(f"the chat log never settled: {seen[-frames:]}")
        await pilot.pause(0.02)
        seen.append((log.scroll_y, log.max_scroll_y, log.size, log.virtual_size))


def record_notifications(app) -> list[tuple[str, str]]:
    """Collect ``(message, severity)`` of every notification the app (or a screen) shows."""
    seen: list[tuple[str, str]] = []
    original = app.notify

    def notify(message, *, title="", severity="information", timeout=None, markup=True):
        seen.append((message, severity))
        return original(message, title=title, severity=severity, timeout=timeout, markup=markup)

    app.notify = notify
    return seen


def texts(app) -> list[tuple[str, str]]:
    """The chat log as ``(role, text)`` pairs."""
    return [(m.role, m.text) for m in app.chat_log.messages()]
