"""A damaged or edited conversation is refused the same way by open, export and list."""

from __future__ import annotations

import pytest

from kvchat.commands.export import export_text
from kvchat.storage import ManifestError


def refused_everywhere(store, conv, other, error=ManifestError, file="manifest.json") -> str:
    with pytest.raises(error) as err:
        store.open(conv.id)
    message = str(err.value)
    assert str(conv.path / file) in message and "\n" not in message
    assert f"kvchat delete {conv.id}" in message
    with pytest.raises(error):
        export_text(store, conv.id, "md")
    rows = {r.id: r for r in store.list()}
    assert rows[conv.id].error == message
    assert rows[other.id].error is None  # other conversations are unaffected
    store.open(other.id).close()
    return message
