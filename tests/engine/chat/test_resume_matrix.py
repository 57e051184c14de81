"""Resume any saved conversation under any ceiling and any form, exactly; and never hold
more than the standard cache when everything fits (real SmolLM2)."""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.chat.conversation import open_session
from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings

pytestmark = pytest.mark.slow

GREEDY = SamplingSettings(max_new_tokens=16)
PROMPTS = ("What is the capital of France?", "And of Germany?", "Which of the two is larger?")
ROOMY_RESIDUAL = CacheSettings(max_mem=10**9, checkpoint="residual", prefill_chunk=16)

MATRIX = {
    # saved with                     resumed with
    "none->1MB": (CacheSettings(prefill_chunk=16), CacheSettings(max_mem=10**6, prefill_chunk=16)),
    "1MB->none": (CacheSettings(max_mem=10**6, prefill_chunk=16), CacheSettings(prefill_chunk=16)),
    "residual->auto": (
        ROOMY_RESIDUAL,
        CacheSettings(max_mem=2 * 10**6, checkpoint="auto", prefill_chunk=16),
    ),
    "auto->residual": (
        CacheSettings(max_mem=2 * 10**6, prefill_chunk=16),
        CacheSettings(max_mem=2 * 10**6, checkpoint="residual", prefill_chunk=16),
    ),
    "residual 1MB->kv none": (
        CacheSettings(max_mem=10**6, checkpoint="residual", prefill_chunk=16),
        CacheSettings(checkpoint="kv", prefill_chunk=16),
    ),
}


@pytest.fixture(scope="module")
def expected(smollm2_loaded):
    reference = ChatSession(smollm2_loaded, cache=CacheSettings(kind="standard", prefill_chunk=16))
    tokens = [reference.send(p, GREEDY).tokens for p in PROMPTS]
    return tokens, reference


@pytest.mark.parametrize("name", list(MATRIX))
def test_resume_under_another_ceiling_or_form_continues_exactly(
    smollm2_loaded, tmp_path, expected, name
):
    saved_with, resumed_with = MATRIX[name]
    tokens, reference = expected
    first = open_session(smollm2_loaded, data_dir=tmp_path, cache=saved_with)
    got = [first.send(p, GREEDY).tokens for p in PROMPTS[:2]]
    conv_id = first.conversation.id
    first.close()

    resumed = open_session(
        smollm2_loaded, data_dir=tmp_path, cache=resumed_with, conversation_id=conv_id
    )
    ceiling = resumed_with.max_mem
    if ceiling is not None:
        assert resumed.memory().state_bytes <= ceiling
    got.append(resumed.send(PROMPTS[2], GREEDY).tokens)
    mem = resumed.memory()
    resumed.close()
    assert got == tokens, f"{name}: tokens differ from a process that never stopped"
    assert resumed.token_ids == reference.token_ids
    if ceiling is not None:
        assert mem.state_bytes <= ceiling
    else:
        # No ceiling: everything is K/V, hot, exactly what the standard cache holds.
        assert mem.checkpoint_bytes == 0
        assert mem.hot_kv_bytes == mem.standard_equivalent_bytes
        if saved_with.max_mem is not None and saved_with.max_mem < 10**8:
            return  # saved under streamed attention: same tokens, not the same last bits
        for layer, ref in zip(resumed.cache.layers, reference.cache.layers):
            assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)


def test_a_roomy_ceiling_holds_no_more_than_the_standard_cache(smollm2_loaded):
    session = ChatSession(smollm2_loaded, cache=CacheSettings(max_mem=64 * 10**6))
    for p in PROMPTS:
        session.send(p, GREEDY)
    mem = session.memory()
    assert mem.hot_kv_bytes + mem.checkpoint_bytes <= mem.standard_equivalent_bytes
    assert mem.plan == "all in memory" and mem.forms == "kv"
    session.close()


def test_checkpoint_kv_is_honoured_on_resume(smollm2_loaded, tmp_path):
    first = open_session(smollm2_loaded, data_dir=tmp_path, cache=ROOMY_RESIDUAL)
    first.send(PROMPTS[0], GREEDY)
    conv_id = first.conversation.id
    first.close()
    resumed = open_session(
        smollm2_loaded,
        data_dir=tmp_path,
        cache=CacheSettings(max_mem=10**9, checkpoint="kv"),
        conversation_id=conv_id,
    )
    assert set(resumed.forms) == {"kv"} and resumed.memory().forms == "kv"
    assert resumed.memory().checkpoint_bytes == 0  # the saved residuals were not loaded
    resumed.close()


def test_a_kv_window_that_starts_inside_a_saved_residual_call_resumes_exactly(
    smollm2_loaded, tmp_path, expected
):
    """Saved as residual checkpoints (replayed one whole call at a time), resumed as K/V with
    a window whose first row lies inside the first 16-row call: the window starts at that
    call instead, the rows before it go out again as K/V, and the next turn is exact."""
    tokens, _ = expected
    first = open_session(smollm2_loaded, data_dir=tmp_path, cache=ROOMY_RESIDUAL)
    got = [first.send(p, GREEDY).tokens for p in PROMPTS[:2]]
    conv_id, n_cached = first.conversation.id, first.cache.get_seq_length()
    first.close()
    window = CacheSettings(checkpoint="kv", hot_window=n_cached - 8, prefill_chunk=16)
    resumed = open_session(smollm2_loaded, data_dir=tmp_path, cache=window, conversation_id=conv_id)
    assert {layer.hot_length for layer in resumed.cache.layers} == {n_cached - 8}
    got.append(resumed.send(PROMPTS[2], GREEDY).tokens)
    resumed.close()
    assert got == tokens
