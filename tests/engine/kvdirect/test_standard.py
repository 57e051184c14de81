"""StandardCache: transformers' DynamicCache with the session's cache calls, its own
ceiling check included (a tiny Llama and real SmolLM2 sessions)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings
from kvchat.engine.kvdirect.footprint import footprint_from_config
from kvchat.engine.kvdirect.standard import StandardCache
from kvchat.errors import NeedsDiskTierError
from tests.engine.kvdirect.test_cache_exact import run_conversation, tiny_model


def test_it_gives_dynamic_caches_bits_and_counts_its_bytes():
    model = tiny_model("llama")
    footprint = footprint_from_config(model.config, "float32")
    ours = StandardCache(model.config, footprint, None)
    tokens, logits = run_conversation(model, ours)
    ref = DynamicCache(config=model.config)
    ref_tokens, ref_logits = run_conversation(model, ref)
    assert tokens == ref_tokens and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    assert ours.resident_bytes() == footprint.standard_cache_bytes(ours.get_seq_length())
    assert ours.release_reserve() is False and ours.disk_bytes() == 0
    ours.close()  # a no-op: the cache still answers
    assert ours.get_seq_length() == ref.get_seq_length()


def test_its_ceiling_refuses_a_call_before_anything_is_fed():
    model = tiny_model("llama")
    footprint = footprint_from_config(model.config, "float32")
    one_token = footprint.standard_cache_bytes(1)
    cache = StandardCache(model.config, footprint, max_mem=10 * one_token)
    cache.prepare(10)
    with pytest.raises(NeedsDiskTierError, match="--cache kvdirect or raise --max-mem"):
        cache.prepare(11)
    assert cache.get_seq_length() == 0


@pytest.mark.slow
def test_a_standard_session_under_a_ceiling_says_what_to_do(smollm2_loaded):
    session = ChatSession(smollm2_loaded, cache=CacheSettings(kind="standard", max_mem=200_000))
    assert isinstance(session.cache, StandardCache)
    with pytest.raises(NeedsDiskTierError, match="the standard cache needs"):
        session.send("Tell me about the sea. " * 20, SamplingSettings(max_new_tokens=4))
    assert session.cache.get_seq_length() == 0
    session.close()
