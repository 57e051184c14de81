"""Bit-identity on the real models: SmolLM2-135M (Llama family) and Gemma 3 270M.

Gemma 3 270M has sliding layers (window 512) and global layers with q/k norms and two RoPE
bases; the turns below take the context past the window.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.engine.kvdirect.test_cache_exact import kvdirect, run_conversation

pytestmark = pytest.mark.slow


def assert_identical(model, hot_windows, **conversation):
    ref_tokens, ref_logits = run_conversation(
        model, DynamicCache(config=model.config), **conversation
    )
    for hot in hot_windows:
        cache = kvdirect(model, hot)
        tokens, logits = run_conversation(model, cache, **conversation)
        cache.detach()
        assert tokens == ref_tokens, f"B={hot}: greedy tokens differ"
        for step, (a, b) in enumerate(zip(logits, ref_logits)):
            assert torch.equal(a, b), f"B={hot}: logits differ at step {step}"
        assert cache.stats.recomputed_tokens > 0


def test_smollm2_logits_bit_identical(smollm2_loaded):
    assert_identical(smollm2_loaded.model, [4, 70], new_per_turn=24)


def test_smollm2_bf16_logits_bit_identical(smollm2_loaded_bf16):
    assert_identical(smollm2_loaded_bf16.model, [50], new_per_turn=16)


def test_gemma3_270m_past_the_sliding_window(gemma270m_loaded):
    model = gemma270m_loaded.model
    window = model.config.sliding_window
    turns = (window - 150, 200, 40)  # straddles the window during the second turn
    assert sum(turns) > window
    assert_identical(model, [16, 300], turn_lengths=turns, new_per_turn=22, chunk=128)
