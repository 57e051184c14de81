"""Slash commands typed in the message box, and the command palette's entries.

The table here is the single source for ``/help``, the help screen and the palette.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlashCommand:
    name: str
    args: str
    help: str
    action: str  # the app action it runs (``action_<name>``), given the argument text


SLASH_COMMANDS: tuple[SlashCommand, ...] = (
    SlashCommand("new", "", "start a new conversation", "new"),
    SlashCommand("resume", "[ID]", "list saved conversations, or resume one by id", "resume"),
    SlashCommand("clear", "", "clear the screen (the conversation goes on)", "clear"),
    SlashCommand("regenerate", "", "answer your last message again, as a branch", "regenerate"),
    SlashCommand("edit", "", "edit one of your messages, as a branch", "edit"),
    SlashCommand("copy", "[code]", "copy the last reply (or its last code block)", "copy"),
    SlashCommand("model", "[NAME]", "show the model, or load another one", "model"),
    SlashCommand("mem", "", "memory comparison: kvchat vs the standard cache", "memory"),
    SlashCommand("settings", "", "system prompt and sampling for this conversation", "settings"),
    SlashCommand("system", "TEXT", "set the system prompt of this conversation", "system"),
    SlashCommand("help", "", "keys and commands", "help"),
    SlashCommand("quit", "", "leave kvchat", "quit"),
)

BY_NAME = {c.name: c for c in SLASH_COMMANDS}


def parse(text: str) -> tuple[SlashCommand, str] | None:
    """``"/model gemma-3-4b"`` -> (the model command, ``"gemma-3-4b"``); None if not a command.

    Raises ValueError with a one-line message for an unknown command. Text starting with
    two slashes (``//etc``) is sent to the model as ``/etc``.
    """
    if not text.startswith("/") or text.startswith("//"):
        return None
    name, _, arg = text[1:].partition(" ")
    name = name.strip().lower()
    command = BY_NAME.get(name)
    if command is None:
        known = " ".join(f"/{c.name}" for c in SLASH_COMMANDS)
        raise ValueError(f"unknown command /{name}; try one of {known}")
    return command, arg.strip()


KEYS: tuple[tuple[str, str], ...] = (
    ("Enter", "send the message"),
    ("Shift+Enter, Ctrl+J", "new line in the message"),
    ("Up (empty box)", "recall an earlier message"),
    ("Esc", "stop the reply; what was said is kept"),
    ("F1", "this help"),
    ("F2", "settings: system prompt, sampling"),
    ("F3", "memory comparison, turn by turn"),
    ("F4", "saved conversations"),
    ("Ctrl+N", "new conversation"),
    ("Ctrl+L", "clear the screen"),
    ("Ctrl+R", "regenerate the last reply (a branch; the old one stays in F4)"),
    ("Ctrl+B", "edit your last message (again: an earlier one); Enter sends it as a branch"),
    ("F5", "copy the last reply (/copy code: its last code block)"),
    ("Ctrl+P", "command palette"),
    ("Ctrl+Q", "quit"),
)

GAUGE_HELP = (
    "kvchat: the conversation state resident in memory (hot K/V, residual checkpoints, "
    "token ids, recompute scratch) against the --max-mem ceiling. standard: what "
    "transformers' default cache would hold for the same tokens. Weights and process RSS "
    "are shown beside them, never counted in the state."
)


def help_rows() -> list[tuple[str, list[tuple[str, str]]]]:
    """Sections of (left, right) rows for the help screen."""
    cmds = [(f"/{c.name}{' ' + c.args if c.args else ''}", c.help) for c in SLASH_COMMANDS]
    cmds.append(("//text", "send a message that starts with /"))
    return [("Keys", list(KEYS)), ("Commands", cmds)]
