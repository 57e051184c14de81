"""Saving after every turn and resuming exactly, on the real default model."""

from __future__ import annotations

import pytest
import torch

from kvchat.commands.export import export_text
from kvchat.engine.chat.conversation import open_session
from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings
from kvchat.storage import (
    ConversationLockedError,
    ConversationStore,
    ModelMismatchError,
    SaveFailedError,
    SegmentCorruptedError,
)
from kvchat.storage.manifest import FORMAT_VERSION

pytestmark = pytest.mark.slow

GREEDY = SamplingSettings(max_new_tokens=20)
PROMPTS = ("What is the capital of France?", "And of Germany?", "Which of the two is larger?")

CACHES = {
    "residual-B5": CacheSettings(hot_window=5, prefill_chunk=16),
    "no-ceiling": CacheSettings(),
    "standard": CacheSettings(kind="standard"),
    # a ceiling far below the checkpoints: saved turns are read back from their segments
    "disk-tier-600KB": CacheSettings(max_mem=600_000, prefill_chunk=16),
}


def held_kv(session: ChatSession) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in session.cache.layers]


@pytest.mark.parametrize("name", list(CACHES))
def test_resume_continues_exactly_like_a_process_that_never_stopped(smollm2_loaded, tmp_path, name):
    cache = CACHES[name]
    reference = ChatSession(smollm2_loaded, cache=cache)
    expected = [reference.send(p, GREEDY).tokens for p in PROMPTS]

    first = open_session(smollm2_loaded, data_dir=tmp_path, cache=cache)
    got = [first.send(p, GREEDY).tokens for p in PROMPTS[:2]]
    conv_id = first.conversation.id
    first.close()

    resumed = open_session(smollm2_loaded, data_dir=tmp_path, cache=cache, conversation_id=conv_id)
    assert resumed.messages == reference.messages[:4]
    got.append(resumed.send(PROMPTS[2], GREEDY).tokens)
    assert got == expected
    assert resumed.token_ids == reference.token_ids
    for (k, v), (rk, rv) in zip(held_kv(resumed), held_kv(reference)):
        assert torch.equal(k, rk) and torch.equal(v, rv)  # bit-identical state
    if cache.kind == "kvdirect":
        # The checkpoints too: every cold position's K/V, replayed or read back, are equal.
        for ours, ref in zip(resumed.cache.layers, reference.cache.layers):
            begin = max(ours.store.start or 0, ref.store.start or 0)
            end = min(ours.hot_from, ref.hot_from)
            if begin < end:
                k, v = ours.cold_kv(begin, end)
                rk, rv = ref.cold_kv(begin, end)
                assert torch.equal(k, rk) and torch.equal(v, rv)
    assert resumed.memory().disk_bytes > 0
    resumed.close()


def test_a_rebuilt_history_is_saved_as_a_rebase_turn_and_resumes_exactly(smollm2_loaded, tmp_path):
    """When the chat template rewrites earlier turns, the session rebuilds its state from
    the text; the next save must carry that whole state, and resume must start from it."""
    cache = CacheSettings(hot_window=5, prefill_chunk=16)

    def two_turns(session: ChatSession) -> None:
        session.send(PROMPTS[0], GREEDY)
        session._rendered = "<a template that rendered history differently>"
        assert session.send(PROMPTS[1], GREEDY).fell_back_to_full_prefill

    reference = ChatSession(smollm2_loaded, cache=cache)
    two_turns(reference)
    expected = reference.send(PROMPTS[2], GREEDY).tokens

    first = open_session(smollm2_loaded, data_dir=tmp_path, cache=cache)
    two_turns(first)
    conv_id = first.conversation.id
    assert [t.extra.get("rebase") for t in first.conversation.manifest.turns] == [False, True]
    first.close()
    again = open_session(smollm2_loaded, data_dir=tmp_path, cache=cache, conversation_id=conv_id)
    assert again.token_ids == reference.token_ids[: len(again.token_ids)]
    assert again.send(PROMPTS[2], GREEDY).tokens == expected
    assert again.token_ids == reference.token_ids
    again.close()


def test_every_turn_is_saved_with_what_resume_needs(smollm2_loaded, tmp_path):
    session = open_session(
        smollm2_loaded, data_dir=tmp_path, cache=CacheSettings(hot_window=4), system="Be brief."
    )
    for prompt in PROMPTS[:2]:
        session.send(prompt, GREEDY)
    manifest = session.conversation.manifest
    assert len(manifest.turns) == 2 and manifest.format_version == FORMAT_VERSION
    assert manifest.token_ids == session.token_ids
    assert [m["role"] for m in manifest.messages] == ["user", "assistant"] * 2
    assert manifest.model.fingerprint == smollm2_loaded.fingerprint
    assert manifest.model.dtype == "float32"
    assert manifest.engine_state["system"] == "Be brief."
    session.close()


def test_a_second_open_is_refused_while_the_first_holds_it(smollm2_loaded, tmp_path):
    session = open_session(smollm2_loaded, data_dir=tmp_path, cache=CacheSettings())
    session.send("Hi!", GREEDY)
    with pytest.raises(ConversationLockedError, match="open in"):
        open_session(
            smollm2_loaded,
            data_dir=tmp_path,
            cache=CacheSettings(),
            conversation_id=session.conversation.id,
        )
    session.close()


def test_another_dtype_is_refused_and_named(smollm2_loaded, smollm2_loaded_bf16, tmp_path):
    session = open_session(smollm2_loaded, data_dir=tmp_path, cache=CacheSettings())
    session.send("Hi!", GREEDY)
    conv_id = session.conversation.id
    session.close()
    with pytest.raises(ModelMismatchError, match="float32"):
        open_session(
            smollm2_loaded_bf16, data_dir=tmp_path, cache=CacheSettings(), conversation_id=conv_id
        )


def test_a_corrupted_segment_names_the_file_and_the_store_still_works(smollm2_loaded, tmp_path):
    session = open_session(smollm2_loaded, data_dir=tmp_path, cache=CacheSettings(hot_window=4))
    session.send("Hi!", GREEDY)
    session.send("How are you?", GREEDY)
    conv = session.conversation
    segment = conv.segment_path(2)
    session.close()
    data = bytearray(segment.read_bytes())
    data[-10] ^= 0xFF
    segment.write_bytes(bytes(data))
    with pytest.raises(SegmentCorruptedError, match="turn-0002"):
        open_session(
            smollm2_loaded,
            data_dir=tmp_path,
            cache=CacheSettings(hot_window=4),
            conversation_id=conv.id,
        )
    store = ConversationStore(tmp_path)
    assert [s.id for s in store.list()] == [conv.id]
    assert "How are you?" in export_text(store, conv.id, "md")


def test_a_failed_save_loses_nothing_and_the_next_turn_catches_up(
    smollm2_loaded, tmp_path, monkeypatch
):
    cache = CacheSettings(hot_window=4)
    session = open_session(smollm2_loaded, data_dir=tmp_path, cache=cache)
    session.send(PROMPTS[0], GREEDY)
    conv = session.conversation
    real_append = conv.append_turn

    def disk_full(**kwargs):
        raise SaveFailedError("saving turn 2 failed (No space left on device); turn 1 is intact")

    monkeypatch.setattr(conv, "append_turn", disk_full)
    result = session.send(PROMPTS[1], GREEDY)
    assert result.reply and "No space left" in result.error
    assert len(conv.manifest.turns) == 1  # the earlier turn is intact on disk
    monkeypatch.setattr(conv, "append_turn", real_append)
    session.send(PROMPTS[2], GREEDY)
    assert conv.manifest.token_ids == session.token_ids
    conv_id = conv.id
    session.close()
    resumed = open_session(smollm2_loaded, data_dir=tmp_path, cache=cache, conversation_id=conv_id)
    assert resumed.messages == session.messages
    resumed.close()
