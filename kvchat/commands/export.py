"""``kvchat export``: a saved conversation's text as Markdown or JSON, from its header and
journal alone (``ConversationStore.read``), so it works while the conversation is open
elsewhere and when a segment is damaged. Every field is made safe for a terminal."""

from __future__ import annotations

import json
from typing import Literal

from kvchat.storage import ConversationStore
from kvchat.storage.text import escape_json_for_terminal, safe_markdown_text


def export_text(store: ConversationStore, conv_id: str, fmt: Literal["md", "json"] = "md") -> str:
    if fmt not in ("md", "json"):
        raise ValueError(f"export format must be 'md' or 'json', not {fmt!r}")
    m = store.read(conv_id)
    if fmt == "json":
        doc = {
            "id": m.id,
            "title": m.title,
            "created": m.created,
            "updated": m.updated,
            "model": {"name": m.model.name, "dtype": m.model.dtype},
            "settings": m.settings,
            "messages": m.messages,
        }
        return escape_json_for_terminal(json.dumps(doc, indent=2, ensure_ascii=False)) + "\n"

    def one(text: str) -> str:
        return safe_markdown_text(text, multiline=False)

    lines = [
        f"# {one(m.title) or 'Untitled conversation'}",
        "",
        f"- id: `{m.id}`",
        f"- model: {one(m.model.name)} ({one(m.model.dtype)})",
        f"- created: {one(m.created)}",
        f"- updated: {one(m.updated)}",
    ]
    for msg in m.messages:
        role = one(msg["role"].capitalize())
        lines += ["", f"## {role}", "", safe_markdown_text(msg["content"].rstrip("\n"))]
    return "\n".join(lines) + "\n"
