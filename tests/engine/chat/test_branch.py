"""Branching a saved conversation, on real SmolLM2: an edit (fork at turn k, then a new
prompt) and a regenerate (fork at the turn before the last, the last prompt again) continue
from the saved state, read only the new tokens, and give what a process that was fed that
history from the start gives: the standard cache's tokens, and with no ceiling the same K/V
bits; under a ceiling that uses the disk tier too."""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.chat.conversation import open_session, regenerable_prompt
from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings
from kvchat.errors import KvchatError
from kvchat.storage import ConversationStore

pytestmark = pytest.mark.slow

GREEDY = SamplingSettings(max_new_tokens=24)
SAMPLED = SamplingSettings(temperature=0.7, seed=5, max_new_tokens=24)
PROMPTS = ("What is the capital of France?", "And of Germany?", "Which of the two is larger?")
EDITED = "And of Italy? Answer in one sentence."

CEILINGS = {
    "no ceiling": CacheSettings(prefill_chunk=16),
    "2 MB, disk tier": CacheSettings(max_mem=2 * 10**6, prefill_chunk=16),
}


def fresh(loaded, settings: CacheSettings, turns) -> ChatSession:
    """A session that was fed ``turns`` (prompt, sampling) from the start, never saved."""
    session = ChatSession(loaded, cache=settings)
    for prompt, sampling in turns:
        session.send(prompt, sampling)
    return session


def saved(loaded, data_dir, settings: CacheSettings) -> str:
    session = open_session(loaded, data_dir=data_dir, cache=settings)
    for prompt in PROMPTS:
        session.send(prompt, GREEDY)
    conv_id = session.conversation.id
    session.close()
    return conv_id


def same_kv(a: ChatSession, b: ChatSession) -> None:
    for mine, theirs in zip(a.cache.layers, b.cache.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@pytest.mark.parametrize("name", list(CEILINGS))
def test_an_edit_continues_from_the_fork_like_a_fresh_run_of_that_history(
    smollm2_loaded, tmp_path, name
):
    settings = CEILINGS[name]
    conv_id = saved(smollm2_loaded, tmp_path, settings)
    store = ConversationStore(tmp_path)
    fork = store.fork(conv_id, turn=1)

    branch = open_session(smollm2_loaded, data_dir=tmp_path, cache=settings, conversation_id=fork)
    before = len(branch.token_ids)
    result = branch.send(EDITED, GREEDY)
    if settings.max_mem is not None:
        assert branch.memory().disk_tier and branch.memory().state_bytes <= settings.max_mem
    # Only the new message was read (plus the last reply's final token, which a turn
    # leaves unfed), never the history before it.
    new_ids = len(branch.token_ids) - before - len(result.tokens)
    assert not result.fell_back_to_full_prefill
    assert new_ids <= result.prompt_tokens <= new_ids + 1 < before
    history = [(PROMPTS[0], GREEDY), (EDITED, GREEDY)]
    standard = fresh(smollm2_loaded, CacheSettings(kind="standard", prefill_chunk=16), history)
    assert branch.token_ids == standard.token_ids
    if settings.max_mem is None:
        same_kv(branch, standard)
    branch.close()
    with store.open(conv_id) as parent:  # the original keeps its three turns
        assert [m["content"] for m in parent.manifest.messages][4] == PROMPTS[2]


def test_a_regenerated_reply_is_the_reply_a_fresh_run_samples_with_that_seed(
    smollm2_loaded, tmp_path
):
    settings = CEILINGS["2 MB, disk tier"]
    conv_id = saved(smollm2_loaded, tmp_path, settings)
    store = ConversationStore(tmp_path)
    prompt = regenerable_prompt(store, conv_id)
    assert prompt == PROMPTS[2]
    fork = store.fork(conv_id, turn=2)
    branch = open_session(smollm2_loaded, data_dir=tmp_path, cache=settings, conversation_id=fork)
    again = branch.send(prompt, SAMPLED)
    branch.close()
    history = [(PROMPTS[0], GREEDY), (PROMPTS[1], GREEDY), (PROMPTS[2], SAMPLED)]
    standard = fresh(smollm2_loaded, CacheSettings(kind="standard", prefill_chunk=16), history)
    assert again.tokens == standard.token_ids[-len(again.tokens) :]
    assert branch.token_ids == standard.token_ids


def test_in_place_the_last_turn_is_replaced_and_the_rest_kept(smollm2_loaded, tmp_path):
    settings = CEILINGS["no ceiling"]
    conv_id = saved(smollm2_loaded, tmp_path, settings)
    store = ConversationStore(tmp_path)
    assert store.drop_last_turn(conv_id) == 2
    session = open_session(
        smollm2_loaded, data_dir=tmp_path, cache=settings, conversation_id=conv_id
    )
    session.send(PROMPTS[2], SAMPLED)
    session.close()
    history = [(PROMPTS[0], GREEDY), (PROMPTS[1], GREEDY), (PROMPTS[2], SAMPLED)]
    standard = fresh(smollm2_loaded, CacheSettings(kind="standard", prefill_chunk=16), history)
    with store.open(conv_id) as conv:
        assert len(conv.manifest.turns) == 3
        assert conv.manifest.token_ids == standard.token_ids


def test_regenerating_needs_a_reply(smollm2_loaded, tmp_path):
    session = open_session(smollm2_loaded, data_dir=tmp_path, cache=CEILINGS["no ceiling"])
    session.send(PROMPTS[0], GREEDY)
    conv_id = session.conversation.id
    session.close()
    store = ConversationStore(tmp_path)
    empty = store.fork(conv_id, turn=0)
    with pytest.raises(KvchatError, match="no reply to regenerate yet"):
        regenerable_prompt(store, empty)
    # A fork at turn 0 still knows how it was made: a new first turn is a fresh run's.
    branch = open_session(
        smollm2_loaded, data_dir=tmp_path, cache=CEILINGS["no ceiling"], conversation_id=empty
    )
    branch.send(EDITED, GREEDY)
    standard = fresh(
        smollm2_loaded, CacheSettings(kind="standard", prefill_chunk=16), [(EDITED, GREEDY)]
    )
    assert branch.token_ids == standard.token_ids
    branch.close()
