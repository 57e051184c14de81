"""The decode loop hands the reply's freed heap back to the OS once the reply is done."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvchat.engine.chat.generate import generate
from kvchat.engine.chat.settings import SamplingSettings
from kvchat.engine.models import heap
from kvchat.lab.tiny_models import tiny_model


def test_freed_heap_is_returned_after_the_last_token(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama")
    tokens: list[int] = []
    trims: list[int] = []  # how many tokens were out when each trim ran
    monkeypatch.setattr(heap, "return_freed_memory", lambda: trims.append(len(tokens)))

    outcome = generate(
        model,
        DynamicCache(config=model.config),
        list(range(3, 40)),
        device=torch.device("cpu"),
        settings=SamplingSettings(max_new_tokens=6),
        stop_ids=set(),
        prefill_chunk=16,
        on_token=lambda t: tokens.append(t) and None,
    )
    assert outcome.finish_reason == "length" and len(outcome.tokens) == 6
    assert trims == [6], "one trim, after the reply, never inside the timed decode loop"


def test_the_cache_prepares_each_forward_call_itself(tmp_path) -> None:
    """``generate`` calls nobody back: a session's cache plans every call under its ceiling
    (here moving rows to disk) and logs the calls' rows, which the session reads after."""
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.chat.settings import CacheSettings
    from kvchat.engine.kvdirect.footprint import footprint_from_config
    from kvchat.engine.models.loaded import LoadedModel

    model = tiny_model("llama")
    footprint = footprint_from_config(model.config, "float32")
    loaded = LoadedModel(model, None, "tiny llama", torch.device("cpu"), "float32", 0, footprint)
    prompt = list(range(3, 200))

    def reply(settings: CacheSettings):
        session = ChatSession(loaded, cache=settings, spill_root=tmp_path)
        try:
            outcome = generate(
                model,
                session.cache,
                prompt,
                device=torch.device("cpu"),
                settings=SamplingSettings(max_new_tokens=8),
                stop_ids=set(),
                prefill_chunk=64,
            )
            return outcome.tokens, session.cache.calls.take(), session.cache.plan
        finally:
            session.close()

    ceiling = footprint.standard_cache_bytes(len(prompt) + 8) // 3
    tokens, calls, plan = reply(CacheSettings(max_mem=ceiling, checkpoint="kv"))
    standard_tokens, standard_calls, _ = reply(CacheSettings(kind="standard"))
    assert plan is not None and plan.disk_tier, plan
    assert calls.rows == standard_calls.rows == [64, 64, 64, 5] + [1] * 7
    assert 0 < calls.peak_resident_bytes <= ceiling
    assert tokens == standard_tokens
