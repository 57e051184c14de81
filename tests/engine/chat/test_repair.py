"""A damaged segment is rebuilt from the saved token ids, bit for bit (real SmolLM2)."""

from __future__ import annotations

import copy

import pytest

from kvchat.engine.chat.conversation import open_session
from kvchat.engine.chat.repair import RepairError, damaged_turns, repair
from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings
from kvchat.storage import ConversationStore, SegmentCorruptedError
from kvchat.storage.segments import content_digest

pytestmark = pytest.mark.slow

GREEDY = SamplingSettings(max_new_tokens=12)
PROMPTS = ("What is the capital of France?", "And of Germany?", "Which is larger?", "Why?")

SETTINGS = {
    "no ceiling": CacheSettings(prefill_chunk=16),
    "1MB auto (K/V on disk)": CacheSettings(max_mem=10**6, prefill_chunk=16),
    "2MB residual": CacheSettings(max_mem=2 * 10**6, checkpoint="residual", prefill_chunk=16),
    "standard cache": CacheSettings(kind="standard", prefill_chunk=16),
}


@pytest.fixture(scope="module")
def never_stopped(smollm2_loaded):
    session = ChatSession(smollm2_loaded, cache=CacheSettings(kind="standard", prefill_chunk=16))
    return [session.send(p, GREEDY).tokens for p in PROMPTS]


def _save_three_turns(loaded, root, settings) -> tuple[str, dict[int, bytes]]:
    session = open_session(loaded, data_dir=root, cache=settings)
    for prompt in PROMPTS[:3]:
        session.send(prompt, GREEDY)
    conv_id = session.conversation.id
    conversation = session.conversation
    digests = {
        t.index: content_digest(conversation.segment_path(t.index))
        for t in conversation.manifest.turns
    }
    session.close()
    return conv_id, digests


def _flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _open(loaded, root, conv_id):
    return ConversationStore(root).open(
        conv_id, fingerprint=loaded.fingerprint, dtype=loaded.dtype, model_name=loaded.name
    )


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_damaged_segment_is_rebuilt_bit_for_bit_and_resume_continues_exactly(
    smollm2_loaded, tmp_path, never_stopped, name
):
    settings = SETTINGS[name]
    conv_id, original = _save_three_turns(smollm2_loaded, tmp_path, settings)
    conversation = _open(smollm2_loaded, tmp_path, conv_id)
    damaged = conversation.segment_path(2)
    conversation.close()
    _flip_last_byte(damaged)
    with pytest.raises(SegmentCorruptedError, match=f"kvchat repair {conv_id}"):
        open_session(smollm2_loaded, data_dir=tmp_path, cache=settings, conversation_id=conv_id)

    conversation = _open(smollm2_loaded, tmp_path, conv_id)
    try:
        assert damaged_turns(conversation) == [2]
        outcome = repair(smollm2_loaded, conversation, spill_root=tmp_path)
        assert outcome.rebuilt == (2,) and outcome.verified == (1, 3)
        for index, data in original.items():
            assert content_digest(conversation.segment_path(index)) == data, f"turn {index}"
        assert damaged_turns(conversation) == []
    finally:
        conversation.close()
    segments_dir = damaged.parent
    assert sorted(p.name for p in segments_dir.iterdir()) == sorted(
        f"turn-000{i}.safetensors" for i in original
    ), "no staged copy is left behind"

    resumed = open_session(
        smollm2_loaded, data_dir=tmp_path, cache=settings, conversation_id=conv_id
    )
    try:
        assert resumed.send(PROMPTS[3], GREEDY).tokens == never_stopped[3]
    finally:
        resumed.close()


def test_nothing_damaged_means_nothing_rewritten(smollm2_loaded, tmp_path):
    conv_id, original = _save_three_turns(smollm2_loaded, tmp_path, SETTINGS["no ceiling"])
    conversation = _open(smollm2_loaded, tmp_path, conv_id)
    try:
        assert repair(smollm2_loaded, conversation) == type(repair(smollm2_loaded, conversation))(
            (), ()
        )
        assert all(content_digest(conversation.segment_path(i)) == d for i, d in original.items())
    finally:
        conversation.close()


def _edit_turn_extra(root, conv_id, index, **changes) -> None:
    """What an older kvchat (or a hostile file) left in a turn's record: the whole manifest
    in one file (format 1), as an older kvchat writes it."""
    conversation = ConversationStore(root).open(conv_id)
    manifest = copy.deepcopy(conversation.manifest)
    for turn in manifest.turns:
        if turn.index == index:
            turn.extra.update(changes)
            for key in [k for k, v in changes.items() if v is None]:
                del turn.extra[key]
    manifest.format_version = 1
    path = conversation.path / "manifest.json"
    conversation.close()
    path.write_text(manifest.to_json())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"calls": None}, "did not record how it was fed"),
        ({"calls": [[1, 10**15]]}, "add up to"),
        ({"calls": "lots"}, "not a list of"),
    ],
)
def test_a_turn_that_cannot_be_replayed_changes_nothing(smollm2_loaded, tmp_path, change, message):
    conv_id, _ = _save_three_turns(smollm2_loaded, tmp_path, SETTINGS["no ceiling"])
    _edit_turn_extra(tmp_path, conv_id, 2, **change)
    conversation = _open(smollm2_loaded, tmp_path, conv_id)
    damaged = conversation.segment_path(2)
    conversation.close()
    _flip_last_byte(damaged)
    before = damaged.read_bytes()
    conversation = _open(smollm2_loaded, tmp_path, conv_id)
    try:
        with pytest.raises(RepairError, match=message) as info:
            repair(smollm2_loaded, conversation)
        assert "\n" not in str(info.value) and f"kvchat export {conv_id}" in str(info.value)
    finally:
        conversation.close()
    assert damaged.read_bytes() == before
