"""Text read from conversation files, made safe to print to a terminal or a Markdown file.

A manifest is a plain file anyone can edit or hand over. Its title or a message holding
``ESC]0;...BEL`` or ``ESC[2J`` would retitle, clear or recolour the user's terminal when
listed or exported. Everything that shows such text goes through this module:

* ``safe_terminal_text``: control characters (C0 except newline and tab, DEL, C1) and the
  Unicode bidi overrides are replaced by visible escapes such as ``\\x1b``, so an escape
  sequence shows as inert text and nothing reaches the terminal that can drive it;
* ``safe_markdown_text``: the same, plus raw HTML neutralised outside code (``<`` becomes
  ``&lt;``) and an unclosed code fence closed, so one message cannot swallow the rest of
  the document;
* ``escape_json_for_terminal``: JSON text whose strings keep their exact content but carry
  no raw control or bidi character (``json.dumps`` escapes only C0).
"""

from __future__ import annotations

import re

# C0 controls other than \t and \n, DEL, C1 controls; then the bidi embeddings, overrides and
# isolates (they reorder what a line shows), and the Unicode line and paragraph separators.
_UNSAFE = "\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029"
_UNSAFE_MULTILINE = re.compile(f"[{_UNSAFE}]")
_UNSAFE_ONE_LINE = re.compile(f"[{_UNSAFE}\t\n]")
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029]")

_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _visible(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe_terminal_text(text: str, *, multiline: bool = True) -> str:
    """``text`` with every character that could drive a terminal shown as an escape.

    Printable text, newlines and tabs are kept; ``multiline=False`` escapes newlines and tabs
    too (a title or a table cell must stay on its row).
    """
    pattern = _UNSAFE_MULTILINE if multiline else _UNSAFE_ONE_LINE
    return pattern.sub(_visible, str(text))


def _escape_html(segment: str) -> str:
    return segment.replace("<", "&lt;")


def _escape_html_outside_code_spans(line: str) -> str:
    out, at = [], 0
    for span in _CODE_SPAN.finditer(line):
        out.append(_escape_html(line[at : span.start()]))
        out.append(span.group())
        at = span.end()
    out.append(_escape_html(line[at:]))
    return "".join(out)


def safe_markdown_text(text: str, *, multiline: bool = True) -> str:
    """``safe_terminal_text`` for Markdown: also no raw HTML outside code, and no code fence
    left open at the end (it would turn everything after it into code)."""
    lines = safe_terminal_text(text, multiline=multiline).split("\n")
    out = []
    fence: str | None = None  # the opening fence while inside a fenced code block
    for line in lines:
        opener = _FENCE.match(line)
        if fence is None:
            if opener:
                fence = opener.group(1)
                out.append(line)
            else:
                out.append(_escape_html_outside_code_spans(line))
            continue
        out.append(line)  # inside code, HTML is shown as text by every renderer
        stripped = line.strip()
        if opener and stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0]):
            fence = None
    if fence is not None:
        out.append(fence)
    return "\n".join(out)


def escape_json_for_terminal(json_text: str) -> str:
    """JSON from ``json.dumps(..., ensure_ascii=False)`` with DEL, C1, bidi and line
    separator characters written as ``\\uXXXX``: the data decodes to exactly the same
    strings, but printing it cannot drive a terminal. (Outside strings JSON holds no such
    characters, so a plain substitution is safe.)"""
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json_text)
