"""Text from conversation files never drives the terminal, in listings or exports."""

from __future__ import annotations

import json
import re

import pytest

from kvchat.commands.export import export_text
from kvchat.storage import ConversationStore
from kvchat.storage.text import escape_json_for_terminal, safe_markdown_text, safe_terminal_text
from tests.storage.test_store import new, turn_tensors

HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x1b[41mred\x9b31m\x7f\u202eevil\r"
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def test_terminal_text_shows_controls_as_inert_escapes():
    shown = safe_terminal_text(HOSTILE)
    assert not RAW_CONTROL.search(shown)
    assert shown == ("\\x1b]0;pwned\\x07\\x1b[2J\\x1b[41mred\\x9b31m\\x7f\\u202eevil\\r")
    assert safe_terminal_text("line 1\n\tline 2 ünï 😀") == "line 1\n\tline 2 ünï 😀"
    assert safe_terminal_text("a\nb\tc", multiline=False) == "a\\nb\\tc"


def test_markdown_text_neutralises_html_outside_code_only():
    text = "hi <script>alert(1)</script> and `a<b` then\n```html\n<b>kept</b>\n```\n<img src=x>"
    assert safe_markdown_text(text) == (
        "hi &lt;script>alert(1)&lt;/script> and `a<b` then\n```html\n<b>kept</b>\n```\n"
        "&lt;img src=x>"
    )
    assert not RAW_CONTROL.search(safe_markdown_text(HOSTILE))


def test_markdown_text_closes_a_fence_left_open():
    assert safe_markdown_text("code:\n~~~~\nx = 1") == "code:\n~~~~\nx = 1\n~~~~"
    assert safe_markdown_text("```\na\n```\n<b>") == "```\na\n```\n&lt;b>"


def test_json_escape_keeps_the_exact_strings():
    value = {"t": HOSTILE + "\u2028ok"}
    dumped = escape_json_for_terminal(json.dumps(value, ensure_ascii=False))
    assert not RAW_CONTROL.search(dumped) and "\u2028" not in dumped
    assert json.loads(dumped) == value


@pytest.fixture
def hostile_conversation(tmp_path):
    store = ConversationStore(tmp_path / "data")
    conv = new(store, model_name="evil\x1b[2Jmodel")
    conv.append_turn(
        messages=[
            {"role": "user", "content": HOSTILE + " <iframe src=x>"},
            {"role": "assistant", "content": "sure\n```\nunclosed"},
            {"role": "user", "content": "next"},
        ],
        token_ids=[1, 2, 3],
        tensors=turn_tensors(1),
    )
    conv.close()
    return store, conv.id


def test_markdown_export_is_safe(hostile_conversation):
    store, cid = hostile_conversation
    md = export_text(store, cid, "md")
    assert not RAW_CONTROL.search(md)
    assert "<iframe" not in md and "&lt;iframe" in md
    assert "\\x1b]0;pwned" in md  # shown, not hidden: the reader sees what the file holds
    # the unclosed fence of message 2 is closed before the next heading
    assert md.index("unclosed\n```") < md.index("## User", md.index("unclosed"))
    assert "evil\\x1b[2Jmodel" in md


def test_json_export_is_safe_and_exact(hostile_conversation):
    store, cid = hostile_conversation
    text = export_text(store, cid, "json")
    assert not RAW_CONTROL.search(text)
    doc = json.loads(text)
    assert doc["messages"][0]["content"] == HOSTILE + " <iframe src=x>"
