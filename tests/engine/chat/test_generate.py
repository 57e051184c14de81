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
