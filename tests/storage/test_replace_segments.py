"""Replacing turns' segments (what `kvchat repair` commits), on real files."""

from __future__ import annotations

import pytest
import torch

from kvchat.storage import FORMAT_VERSION, SaveFailedError, SegmentCorruptedError, segments
from kvchat.storage import conversation as conversation_mod
from tests.storage.test_store import new, save_turns, turn_tensors


@pytest.fixture
def conv(tmp_path):
    from kvchat.storage import ConversationStore

    conversation = new(ConversationStore(tmp_path / "data"))
    save_turns(conversation, 2)
    yield conversation
    conversation.close()


def _reopen(conv):
    from kvchat.storage import ConversationStore

    conv.close()
    return ConversationStore(conv.path.parent.parent).open(conv.id)


def test_a_replaced_segment_is_read_back_and_later_saves_continue(conv):
    rebuilt = turn_tensors(99, n=4)
    info = segments.write_segment_stream(conv.staging_path(1), rebuilt)
    conv.replace_segments({1: info})
    assert all(torch.equal(conv.read_turn_tensors(1)[k], v) for k, v in rebuilt.items())
    assert not any(p.name.startswith(".") for p in (conv.path / "segments").iterdir())

    reopened = _reopen(conv)
    try:
        assert all(torch.equal(reopened.read_turn_tensors(1)[k], v) for k, v in rebuilt.items())
        reopened.read_turn_tensors(2)
        reopened.append_turn(
            messages=[{"role": "user", "content": "q3"}],
            token_ids=[7, 8],
            tensors=turn_tensors(3),
        )
        assert reopened.manifest.format_version == FORMAT_VERSION
    finally:
        reopened.close()
    again = _reopen(reopened)
    try:
        assert len(again.manifest.turns) == 3 and again.manifest.token_ids[-2:] == [7, 8]
        assert all(torch.equal(again.read_turn_tensors(1)[k], v) for k, v in rebuilt.items())
    finally:
        again.close()


def test_a_failure_before_the_manifest_leaves_the_turn_damaged_not_misread(conv, monkeypatch):
    info = segments.write_segment_stream(conv.staging_path(1), turn_tensors(99, n=4))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(conversation_mod, "write_text_atomic", full_disk)
    with pytest.raises(SaveFailedError, match="run the repair again"):
        conv.replace_segments({1: info})
    monkeypatch.undo()
    reopened = _reopen(conv)
    try:
        with pytest.raises(SegmentCorruptedError, match="kvchat repair"):
            reopened.read_turn_tensors(1)
        reopened.read_turn_tensors(2)  # the other turns are untouched
    finally:
        reopened.close()
