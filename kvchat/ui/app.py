"""The kvchat terminal app: chat, live memory gauge, comparison panel, saved conversations.

The window appears at once; the model loads on the engine thread (see ``engine_thread.py``)
with a progress line at the top. Everything the engine says comes back as a message
(``messages.py``); every user error is shown as a notification or a modal with the engine's
one-line wording, never a traceback. The app talks to the engine only through a
:class:`~kvchat.ui.backend.Backend`, so tests drive it with a fake.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from textual import events, on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, ProgressBar, Static

from kvchat.engine.chat.settings import SamplingSettings
from kvchat.errors import KvchatError
from kvchat.ui import commands
from kvchat.ui.backend import Backend, MemorySnapshot, ModelView, ResumedConversation
from kvchat.ui.engine_thread import EngineThread
from kvchat.ui.format import count, fmt_bytes
from kvchat.ui.messages import (
    Branched,
    ConversationStarted,
    EngineFailed,
    Loaded,
    LoadProgress,
    MemoryUpdate,
    PrefillProgress,
    ReplyChunk,
    ReplyDone,
)
from kvchat.ui.screens.conversations import ConversationsScreen
from kvchat.ui.screens.error import ErrorScreen
from kvchat.ui.screens.help import HelpScreen
from kvchat.ui.screens.memory import MemoryScreen
from kvchat.ui.screens.settings import ChatSettings, SettingsScreen
from kvchat.ui.widgets.chat_log import FINISH_NOTES, ChatLog, MessageView
from kvchat.ui.widgets.comparison import ComparisonPanel
from kvchat.ui.widgets.memory_gauge import MemoryGauge
from kvchat.ui.widgets.prompt_input import PromptInput
from kvchat.units import error_line

SIDE_PANEL_MIN_WIDTH = 120  # columns from which the comparison panel sits beside the chat
MEMORY_INTERVAL = 0.2  # seconds between engine memory snapshots while a reply streams
RSS_INTERVAL = 0.25  # seconds between process RSS readings while the engine works
CLOSE_TIMEOUT = 5.0  # seconds to wait at exit for the engine to close the session
PREFILL_NOTE_MIN_TOKENS = 1024  # shorter prompts are read in about a second
LOAD_PROGRESS_W = 22  # columns of the load progress bar beside the status line
FAILURE_TITLES = {"send": "no reply", "resume": "cannot resume", "branch": "cannot branch"}
REGENERATE_TEMPERATURE = 0.7  # greedy settings would only give the same reply again
WELCOME = (
    "Ask anything. The gauge below compares the conversation state kvchat keeps in memory "
    "with the standard cache for the same tokens; f3 shows the comparison turn by turn. "
    "/help lists the commands."
)


class KvchatApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "kvchat"
    BINDINGS = [
        Binding("escape", "stop", "Stop", key_display="esc"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
        Binding("f1", "help", "Help"),
        Binding("f2", "settings", "Settings"),
        Binding("f3", "memory", "Memory"),
        Binding("f4", "resume", "Chats"),
        Binding("ctrl+n", "new", "New", show=False),
        Binding("ctrl+l", "clear", "Clear", show=False),
        Binding("ctrl+r", "regenerate", "Regenerate", show=False),
        Binding("ctrl+b", "edit", "Edit", show=False),
        Binding("f5", "copy", "Copy", show=False),
    ]

    # What the status line, the gauge and the key bindings follow: each change redraws them
    # (the watchers below), so no handler has to remember to.
    phase = reactive("loading", init=False)  # loading | ready | failed
    busy = reactive(False, init=False, bindings=True)  # a reply is streaming
    load_note = reactive("", init=False)  # what loading is doing now
    prefill_note = reactive("", init=False)  # "reading the prompt 40%" for a long prompt

    def __init__(self, backend: Backend, *, memory_interval: float = MEMORY_INTERVAL) -> None:
        super().__init__()
        self.backend = backend
        self.launch = backend.launch
        self.memory_interval = memory_interval
        self.settings = ChatSettings(system=self.launch.system)
        self._applied_system = self.launch.system
        self.model: ModelView | None = None
        self.turn_memory: list[MemorySnapshot] = []  # snapshot after each turn
        self.live_memory: MemorySnapshot | None = None
        self.load_error: str | None = None
        self._stop = threading.Event()
        self._reply: MessageView | None = None
        self._engine = EngineThread()
        self.unsaved_turns: list[int] = []  # answered but not on disk (the next save retries)
        self.editing: int | None = None  # which of your messages (1-based) the box edits
        self.handle_signals = False  # run_app sets it: SIGTERM/SIGHUP quit cleanly

    # -- layout ----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        # Kept as attributes: the app reaches them while other screens are on top.
        self.chat_log = ChatLog(id="chat-log")
        self.gauge = MemoryGauge(ceiling=self.launch.max_mem, id="gauge")
        self.prompt = PromptInput(id="prompt")
        self.side_panel = ComparisonPanel(id="side-panel")
        self.status_text = Static(id="status-text", markup=False)
        self.save_notice = Static(id="save-notice", markup=False)
        self.save_notice.display = False
        self.load_progress = ProgressBar(id="load-progress", show_eta=False, show_percentage=False)
        with Horizontal(id="status"):
            yield self.status_text
            yield self.load_progress
        with Horizontal(id="body"):
            with Vertical(id="chat-column"):
                yield self.chat_log
                yield self.save_notice
                yield self.gauge
                yield self.prompt
            yield self.side_panel
        yield Footer(compact=True)

    async def on_mount(self) -> None:
        if self.handle_signals:
            self._quit_on_signals()
        self._fit_side_panel(self.size.width)
        await self.chat_log.add("note", WELCOME)
        self._show_status()
        self.prompt.focus()
        self.set_interval(RSS_INTERVAL, self._poll_rss)
        self._load(None)

    def on_resize(self, event: events.Resize) -> None:
        self._fit_side_panel(event.size.width)
        self._show_status()

    def _quit_on_signals(self) -> None:
        """SIGTERM and SIGHUP (a closed terminal) quit like ctrl+q, so the session is closed
        (spill files removed, the lock released); the exit status is 128 + the signal."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is None:
                continue
            try:
                loop.add_signal_handler(sig, self._terminated, int(sig))
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread, or a platform without them

    def _terminated(self, signum: int) -> None:
        self._stop.set()
        self.exit(return_code=128 + signum)

    def _fit_side_panel(self, width: int) -> None:
        self.side_panel.display = width >= SIDE_PANEL_MIN_WIDTH

    # -- status line -----------------------------------------------------------------------
    def _show_status(self) -> None:
        if not self.is_mounted:
            return
        loading = self.phase == "loading"
        width = self.size.width - (LOAD_PROGRESS_W if loading else 0)
        self.status_text.update(self._status_line(width))
        self.load_progress.display = loading

    def _status_line(self, width: int) -> str:
        """The status line, shortened (least useful parts first) until it fits ``width``."""
        launch = self.launch
        ceiling = f"max-mem {fmt_bytes(launch.max_mem)}" if launch.max_mem else "no ceiling"
        if self.phase == "loading":
            text = f"loading… {self.load_note}" if self.load_note else f"loading {launch.model}…"
            return f" kvchat · {text}"
        if self.phase == "failed":
            return f" kvchat · not loaded: {launch.model} · /model NAME tries another"
        m = self.model
        name = m.name if m else launch.model
        where = f"{m.device} {m.dtype}" if m and m.dtype else ""
        state = "● replying" if self.busy else "ready"
        long_state = "● replying (esc stops)" if self.busy else "ready"
        if self.busy and self.prefill_note:
            state = long_state = f"● {self.prefill_note}"
        kind = launch.cache_kind
        candidates = [
            ["kvchat", f"{long_state} │ {name}", where, kind, ceiling],
            [f"{long_state} │ {name}", where, kind, ceiling],
            [f"{state} │ {name}", where, kind, ceiling],
            [f"{state} │ {name}", where, ceiling],
            [f"{state} │ {name}", ceiling],
        ]
        lines = [" " + " · ".join(p for p in parts if p) for parts in candidates]
        return next((line for line in lines if len(line) <= width), lines[-1])

    def watch_busy(self, busy: bool) -> None:
        if self.is_mounted:
            self.gauge.live = busy
        self._show_status()

    def watch_phase(self) -> None:
        self._show_status()

    def watch_load_note(self) -> None:
        self._show_status()

    def watch_prefill_note(self) -> None:
        self._show_status()

    # -- loading ---------------------------------------------------------------------------
    def _load(self, spec: str | None) -> None:
        self.phase = "loading"
        self.load_note = ""
        post = self.post_message

        def job() -> None:
            try:
                model = self.backend.load(lambda text: post(LoadProgress(text)), spec)
                memory = self.backend.memory()
            except KvchatError as exc:
                post(EngineFailed("load", str(exc)))
            except Exception as exc:  # shown in one line, never a traceback
                post(
                    EngineFailed(
                        "load",
                        f"could not load the model: {error_line(exc, limit=300, with_type=False)}",
                    )
                )
            else:
                post(Loaded(model))
                post(MemoryUpdate(memory))

        self._engine.submit(job)

    def on_load_progress(self, message: LoadProgress) -> None:
        self.load_note = message.text

    def on_loaded(self, message: Loaded) -> None:
        self.model = message.model
        self.phase = "ready"
        self.load_error = None
        self._set_unsaved([])
        self.gauge.weights = message.model.weights_bytes
        self._show_status()
        if self.launch.conversation_id:
            conv_id, self.launch.conversation_id = self.launch.conversation_id, None
            self._open(conv_id)

    # -- sending ---------------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text
        try:
            parsed = commands.parse(text)
        except ValueError as exc:
            self.notify(str(exc), title="command", severity="error")
            return
        if parsed is not None:
            command, arg = parsed
            self.prompt.accept(text)
            await self.run_command(command, arg)
            return
        if text.startswith("//"):
            text = text[1:]
        if not self._can_talk("send a message"):
            return
        self.prompt.accept(event.text)
        if self.editing is not None:
            which, self.editing = self.editing, None
            self._branch(which, text, self.settings.sampling, "edited")
            return
        await self.chat_log.add("user", text)
        self._reply = await self.chat_log.add("assistant", label=self._model_label())
        self._reply.set_meta("…")
        self._stop.clear()
        self.busy = True
        self._send(text, self.settings.copy())

    def _model_label(self) -> str:
        return self.model.name if self.model else "assistant"

    def _can_talk(self, doing: str) -> bool:
        """Whether the engine is free; if not, say why (the message stays in the box)."""
        if self.phase == "loading":
            self.notify(f"the model is still loading; {doing} when it is ready", severity="warning")
            return False
        if self.phase == "failed":
            self.notify(
                "no model is loaded; /model NAME loads one (`kvchat models` lists them)",
                severity="error",
            )
            return False
        if self.busy:
            self.notify(
                f"a reply is streaming; press esc to stop it, then {doing}", severity="warning"
            )
            return False
        return True

    def _send(
        self, text: str, settings: ChatSettings, sampling: SamplingSettings | None = None
    ) -> None:
        post = self.post_message
        sampling = sampling or settings.sampling
        backend = self.backend
        interval = self.memory_interval
        stop = self._stop
        system_changed = settings.system != self._applied_system
        self._applied_system = settings.system

        def job() -> None:
            due = time.monotonic() + interval

            def on_text(chunk: str) -> None:
                nonlocal due
                post(ReplyChunk(chunk))
                now = time.monotonic()
                if now >= due:
                    # Readings are due every interval from the reply's start, not an interval
                    # after whichever chunk came last: the wait for a chunk does not add up.
                    due += interval
                    if due <= now:  # a long pause (a slow step): start the count again
                        due = now + interval
                    try:
                        post(MemoryUpdate(backend.memory()))
                    except Exception:  # a missed reading must not end the reply
                        pass

            try:
                if system_changed:
                    backend.set_system(settings.system)
                turn = backend.send(
                    text,
                    sampling,
                    on_text=on_text,
                    should_stop=stop.is_set,
                    on_progress=lambda done, total: post(PrefillProgress(done, total)),
                )
            except KvchatError as exc:
                post(EngineFailed("send", str(exc)))
            except Exception as exc:  # never a traceback
                post(
                    EngineFailed(
                        "send", f"the reply failed: {error_line(exc, limit=300, with_type=False)}"
                    )
                )
            else:
                post(ReplyDone(turn))

        self._engine.submit(job)

    def on_prefill_progress(self, message: PrefillProgress) -> None:
        if message.total < PREFILL_NOTE_MIN_TOKENS or message.done >= message.total:
            self.prefill_note = ""
        else:
            self.prefill_note = f"reading the prompt {100 * message.done // message.total}%"

    async def on_reply_chunk(self, message: ReplyChunk) -> None:
        self.prefill_note = ""
        if self._reply is not None:
            await self._reply.append(message.text)

    def on_memory_update(self, message: MemoryUpdate) -> None:
        if self.busy:
            self.live_memory = message.memory
        self.gauge.show(message.memory)
        self._refresh_panels()

    async def on_reply_done(self, message: ReplyDone) -> None:
        self.prefill_note = ""
        turn = message.turn
        if self._reply is not None:
            notes = [count(turn.tokens, "token"), f"{turn.tokens_per_second:.1f} tok/s"]
            if FINISH_NOTES.get(turn.finish_reason):
                notes.append(FINISH_NOTES[turn.finish_reason])
            if turn.save_error:
                notes.append("not saved")
            await self._reply.finish(turn.reply, " · ".join(notes))
        self._reply = None
        self.turn_memory.append(turn.memory)
        if turn.save_error:
            self._set_unsaved([*self.unsaved_turns, len(self.turn_memory)], turn.save_error)
        else:
            self._set_unsaved([])  # a save writes every turn still pending
        self.live_memory = None
        self.gauge.show(turn.memory)
        self.busy = False
        self._refresh_panels()

    def _set_unsaved(self, turns: list[int], reason: str = "") -> None:
        """Show (until a save succeeds) which turns are only on screen, why, and what to do."""
        self.unsaved_turns = turns
        self.save_notice.display = bool(turns)
        if not turns:
            self.save_notice.update("")
            return
        which = f"turn {turns[0]} is" if len(turns) == 1 else f"turns {turns[0]}-{turns[-1]} are"
        it = "it" if len(turns) == 1 else "them"
        # The store's reason already names its fix (free space, permissions, --data-dir).
        self.save_notice.update(
            f"⚠ {which} not saved: {reason}. Once that is fixed your next message saves {it}; "
            f"quitting now loses {it}."
        )

    def on_engine_failed(self, message: EngineFailed) -> None:
        if message.what == "load":
            self.phase = "failed"
            self.load_error = message.message
            self.model = None
            self.gauge.clear()
            self._show_status()
            self.push_screen(
                ErrorScreen("the model could not be loaded", message.message), self._after_error
            )
            return
        title = FAILURE_TITLES.get(message.what, message.what)
        self.notify(message.message, title=title, severity="error", timeout=12)
        if message.what == "branch":
            self.busy = False
        if message.what == "send":
            if self._reply is not None:
                if self._reply.text:
                    self._reply.set_meta("failed")
                else:
                    self._reply.remove()
            self._reply = None
            self.live_memory = None
            self.busy = False

    def _after_error(self, choice: str | None) -> None:
        if choice == "quit":
            self.exit()

    def _refresh_panels(self) -> None:
        self.side_panel.set_data(self.turn_memory, self.live_memory)
        for screen in self.screen_stack:
            if isinstance(screen, MemoryScreen):
                screen.update(self.turn_memory, self.live_memory)

    def _poll_rss(self) -> None:
        try:
            rss = self.backend.process_rss()
        except Exception:  # a missing reading is not worth an error
            return
        if rss is not None:
            self.gauge.rss = rss

    # -- commands --------------------------------------------------------------------------
    async def run_command(self, command: commands.SlashCommand, arg: str = "") -> None:
        """Run a slash command's action; commands that take an argument get it."""
        handler: Callable[..., Any] = getattr(self, f"action_{command.action}")
        result = handler(arg) if command.args else handler()
        if inspect.isawaitable(result):
            await result

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            # Only on the chat screen: elsewhere esc closes the screen on top.
            return (self.busy or self.editing is not None) and len(self.screen_stack) == 1
        return True

    def action_stop(self) -> None:
        if self.editing is not None and not self.busy:
            self._end_edit()
            self.prompt.clear()
            self.notify("edit cancelled", timeout=3)
            return
        if self.busy:
            self._stop.set()
            if self._reply is not None:
                self._reply.set_meta("stopping…")

    # -- branching: regenerate, edit, copy -------------------------------------------------
    def _user_views(self) -> list[MessageView]:
        return [m for m in self.chat_log.messages() if m.role == "user"]

    def action_regenerate(self) -> None:
        """Answer your last message again, in a branch from the turn before it (the old
        reply stays in the original conversation, in F4)."""
        if not self._can_talk("regenerate"):
            return
        users = self._user_views()
        if not users:
            self.notify("nothing to regenerate yet; send a message first", severity="warning")
            return
        sampling = self.settings.sampling
        if sampling.greedy:
            sampling = SamplingSettings(
                temperature=REGENERATE_TEMPERATURE,
                top_p=sampling.top_p,
                seed=sampling.seed,
                max_new_tokens=sampling.max_new_tokens,
            )
            self.notify(
                f"sampling at temperature {REGENERATE_TEMPERATURE}: greedy settings (f2) would "
                "give the same reply again",
                timeout=4,
            )
        self._branch(len(users), users[-1].text, sampling, "regenerated")

    def action_edit(self) -> None:
        """Pick one of your messages to edit: the last one, then each earlier one in turn.
        Sending the edited text branches from the turn before it; esc cancels."""
        if not self._can_talk("edit a message"):
            return
        users = self._user_views()
        if not users:
            self.notify("nothing to edit yet; send a message first", severity="warning")
            return
        which = len(users) if self.editing is None or self.editing <= 1 else self.editing - 1
        self._end_edit()
        self.editing = which
        view = users[which - 1]
        view.add_class("editing")
        view.scroll_visible()
        self.prompt.load_text(view.text)
        self.prompt.focus()
        self.clear_notifications()  # one editing note at a time, for the message picked now
        self.notify(
            f"editing message {which} of {len(users)} · ⏎ sends it as a branch · ctrl+b: an "
            "earlier one · esc cancels",
            timeout=6,
        )
        self.refresh_bindings()

    def _end_edit(self) -> None:
        self.editing = None
        for view in self.chat_log.messages():
            view.remove_class("editing")
        self.refresh_bindings()

    def _branch(self, which: int, text: str, sampling: SamplingSettings, how: str) -> None:
        """Fork before your message ``which``, then send ``text`` in the fork."""
        self._end_edit()
        self._stop.clear()
        self.busy = True
        post = self.post_message

        def job() -> None:
            try:
                resumed = self.backend.branch(which)
                memory = self.backend.memory()
            except KvchatError as exc:
                post(EngineFailed("branch", str(exc)))
            except Exception as exc:  # never a traceback
                post(EngineFailed("branch", error_line(exc, limit=300, with_type=False)))
            else:
                post(Branched(resumed, text, sampling, how))
                post(MemoryUpdate(memory))

        self._engine.submit(job)

    async def on_branched(self, message: Branched) -> None:
        settings = self.settings  # a branch goes on with this conversation's settings
        await self._show_conversation(message.resumed)
        self.settings = settings
        self._applied_system = message.resumed.system
        origin = message.resumed.forked_from
        note = f"{message.how}: a branch of {origin}" if origin else message.how
        await self.chat_log.add("note", f"{note} (the original is kept: f4)")
        await self.chat_log.add("user", message.text)
        self._reply = await self.chat_log.add("assistant", label=self._model_label())
        self._reply.set_meta("…")
        self._send(message.text, self.settings.copy(), sampling=message.sampling)

    def action_copy(self, what: str = "") -> None:
        """Copy the last reply (``/copy code``: its last code block) to the clipboard."""
        replies = [m for m in self.chat_log.messages() if m.role == "assistant" and m.text]
        if not replies:
            self.notify("no reply to copy yet", severity="warning")
            return
        text = replies[-1].text
        if what.strip().lower() == "code":
            blocks = code_blocks(text)
            if not blocks:
                self.notify("the last reply has no code block; /copy copies all of it")
                return
            text, kind = blocks[-1], "code block"
        else:
            kind = "reply"
        self.copy_to_clipboard(text)
        self.notify(f"copied the last {kind} ({count(len(text), 'character')})", timeout=3)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_memory(self) -> None:
        if not isinstance(self.screen, MemoryScreen):
            self.push_screen(MemoryScreen(self.turn_memory, self.live_memory))

    def action_settings(self) -> None:
        self.push_screen(SettingsScreen(self.settings.copy()), self._settings_saved)

    def _settings_saved(self, settings: ChatSettings | None) -> None:
        if settings is not None:
            self.settings = settings
            self.notify("settings saved for this conversation", timeout=3)

    def action_system(self, text: str = "") -> None:
        self.settings.system = text or None
        note = f"system prompt: {text}" if text else "system prompt removed"
        self.notify(note, timeout=3)

    async def action_clear(self) -> None:
        if self.busy:
            self.notify(
                "a reply is streaming; press esc to stop it, then clear", severity="warning"
            )
            return
        await self.chat_log.clear()

    async def action_new(self) -> None:
        if not self._can_talk("start a new conversation"):
            return
        system = self.launch.system
        post = self.post_message

        def job() -> None:
            try:
                self.backend.new_conversation(system)
                memory = self.backend.memory()
            except KvchatError as exc:
                post(EngineFailed("new conversation", str(exc)))
            except Exception as exc:  # never a traceback
                post(EngineFailed("new conversation", error_line(exc, limit=300, with_type=False)))
            else:
                post(ConversationStarted())
                post(MemoryUpdate(memory))

        self._engine.submit(job)

    def action_resume(self, conv_id: str = "") -> None:
        if conv_id:
            self._open(conv_id)
        else:
            self.push_screen(ConversationsScreen(self.backend.list_conversations), self._picked)

    def _picked(self, conv_id: str | None) -> None:
        if conv_id:
            self._open(conv_id)

    def _open(self, conv_id: str) -> None:
        if not self._can_talk("resume a conversation"):
            return
        post = self.post_message

        def job() -> None:
            try:
                resumed = self.backend.open_conversation(conv_id)
                memory = self.backend.memory()
            except KvchatError as exc:
                post(EngineFailed("resume", str(exc)))
            except Exception as exc:  # never a traceback
                post(
                    EngineFailed(
                        "resume",
                        f"cannot resume {conv_id}: {error_line(exc, limit=300, with_type=False)}",
                    )
                )
            else:
                post(ConversationStarted(resumed))
                post(MemoryUpdate(memory))

        self._engine.submit(job)

    async def on_conversation_started(self, message: ConversationStarted) -> None:
        await self.chat_log.clear()
        resumed = message.resumed
        self.live_memory = None
        self._set_unsaved([])
        if resumed is None:
            self.settings = ChatSettings(system=self.launch.system)
            self.turn_memory = []
            await self.chat_log.add("note", "new conversation")
        else:
            await self._show_conversation(resumed, clear=False)
            return
        self._applied_system = self.settings.system
        self._refresh_panels()

    async def _show_conversation(self, resumed: ResumedConversation, clear: bool = True) -> None:
        if clear:
            await self.chat_log.clear()
        self.live_memory = None
        self._set_unsaved([])
        self.settings = ChatSettings(system=resumed.system)
        self.turn_memory = list(resumed.memory_history)
        await self.chat_log.add("note", f"resumed {resumed.title or resumed.id}")
        for m in resumed.messages:
            if m["role"] == "user":
                await self.chat_log.add("user", m["content"])
            elif m["role"] == "assistant":
                await self.chat_log.add("assistant", m["content"], label=self._model_label())
        self._applied_system = self.settings.system
        self._refresh_panels()

    async def action_model(self, spec: str = "") -> None:
        if spec:
            if self.busy:
                self.notify("a reply is streaming; press esc first", severity="warning")
                return
            if self.phase == "loading":
                self.notify("a model is already loading", severity="warning")
                return
            await self.chat_log.clear()
            await self.chat_log.add("note", f"loading {spec}; the conversation starts afresh")
            self.model = None
            self.turn_memory = []
            self.live_memory = None
            self.gauge.clear()  # the old model's figures are not the new one's
            self._set_unsaved([])
            self.launch.model = spec
            self._refresh_panels()
            self._load(spec)
            return
        await self.chat_log.add("note", self._model_summary())

    def _model_summary(self) -> str:
        launch = self.launch
        ceiling = fmt_bytes(launch.max_mem) if launch.max_mem else "none"
        if self.model is None:
            state = "loading" if self.phase == "loading" else f"not loaded ({self.load_error})"
            return f"model {launch.model}: {state}\ncache {launch.cache_kind} · max-mem {ceiling}"
        m = self.model
        template = "chat template" if m.chat_template else "no chat template (plain completion)"
        return (
            f"model {m.name} · {m.dtype} on {m.device} · weights {fmt_bytes(m.weights_bytes)} · "
            f"{template}\ncache {launch.cache_kind} · max-mem {ceiling}\n"
            "/model NAME loads another model (alias, repo id, directory or .gguf)"
        )

    # -- command palette -------------------------------------------------------------------
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield SystemCommand(
            "New conversation", "Start a new conversation (ctrl+n)", self.action_new
        )
        yield SystemCommand(
            "Resume a conversation", "List saved conversations (f4)", self.action_resume
        )
        yield SystemCommand(
            "Memory comparison",
            "kvchat vs the standard cache, turn by turn (f3)",
            self.action_memory,
        )
        yield SystemCommand("Settings", "System prompt and sampling (f2)", self.action_settings)
        yield SystemCommand("Model", "Show the loaded model", self.action_model)
        yield SystemCommand("Clear screen", "Clear the messages on screen", self.action_clear)
        yield SystemCommand(
            "Regenerate", "Answer your last message again, as a branch (ctrl+r)",
            self.action_regenerate,
        )  # fmt: skip
        yield SystemCommand(
            "Edit a message", "Edit one of your messages, as a branch (ctrl+b)", self.action_edit
        )
        yield SystemCommand("Copy the reply", "Copy the last reply (f5)", self.action_copy)
        if self.busy:
            yield SystemCommand(
                "Stop the reply", "End the reply, keep what was said", self.action_stop
            )
        yield SystemCommand("Help", "Keys and slash commands (f1)", self.action_help)
        yield from super().get_system_commands(screen)

    # -- shutdown --------------------------------------------------------------------------
    async def action_quit(self) -> None:
        self._stop.set()  # a streaming reply ends at the next token
        self.exit()

    def on_unmount(self) -> None:
        self._stop.set()  # a streaming reply ends at the next token, then the session closes
        self._engine.submit(self._close_backend)
        self._engine.shutdown()

    def _close_backend(self) -> None:
        try:
            self.backend.close()
        except Exception:  # quitting anyway; atexit still removes spill files
            pass

    def wait_for_engine(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """After the app exits: let the engine thread close the session (bounded wait)."""
        self._engine.join(timeout)


def run_app(opts: dict[str, Any]) -> int:
    """Entry point of ``kvchat`` / ``kvchat chat``: ``opts`` are the click options. Returns
    the exit status: 0, 130 after Ctrl-C, 128+N after signal N."""
    from kvchat.ui.engine_backend import EngineBackend

    app = KvchatApp(EngineBackend(opts))
    app.handle_signals = True
    try:
        app.run()
    except KeyboardInterrupt:  # before the terminal is in raw mode (Ctrl-C is a key after)
        app.wait_for_engine()
        return 130
    app.wait_for_engine()
    return app.return_code or 0


def code_blocks(markdown: str) -> list[str]:
    """The fenced code blocks of a reply, without their fences, in order."""
    blocks, inside, lines = [], False, []
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            if inside:
                blocks.append("\n".join(lines))
                lines = []
            inside = not inside
        elif inside:
            lines.append(line)
    return blocks
