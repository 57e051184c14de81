"""KV-Direct stays exact in every weight mode: bounded equals unbounded in the same mode.

The quantized layers (``kvchat.engine.models.qlinear``) are deterministic for a given call shape,
and the cache replays the original call shapes, so K/V rebuilt from residual checkpoints
must give logits ``torch.equal`` to the standard cache's, in int8 and int4 as in float32
and bfloat16.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import DynamicCache

from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings
from kvchat.engine.models.quantize import is_quantized, quantize_weights
from kvchat.lab.tiny_models import FAMILIES
from tests.engine.kvdirect.test_cache_exact import CHUNK as CHUNK_ROWS
from tests.engine.kvdirect.test_cache_exact import NEW_PER_TURN, TURN_LENGTHS, kvdirect, tiny_model
from tests.engine.kvdirect.test_cache_exact import run_conversation as converse

MODES = [
    ("int8", torch.float32),
    ("int4", torch.float32),
    ("int4", torch.bfloat16),
    ("none", torch.bfloat16),
]


@pytest.mark.slow
@pytest.mark.parametrize("weights,dtype", MODES, ids=["int8", "int4", "int4-bf16", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_bounded_equal_unbounded(family: str, weights: str, dtype) -> None:
    model = quantize_weights(tiny_model(family, dtype), weights)
    if weights != "none":
        assert is_quantized(model, bits=8 if weights == "int8" else None)
    ref_tokens, ref_logits = converse(model, DynamicCache(config=model.config))
    total = sum(TURN_LENGTHS) + len(TURN_LENGTHS) * NEW_PER_TURN
    for hot in (1, 4, 16, total // 2):
        cache = kvdirect(model, hot)
        tokens, logits = converse(model, cache)
        cache.detach()
        assert tokens == ref_tokens, f"{family} {weights} B={hot}: greedy tokens differ"
        assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits)), (
            f"{family} {weights} B={hot}: logits not bit-identical"
        )
        if hot < 16:
            assert cache.stats.recomputed_tokens > 0  # residual form here: replayed


PROMPTS = (
    "Tell me about the history of Rome in a few sentences.",
    "Now summarise that in one line.",
    "List three Roman emperors.",
)


def _three_turns(loaded, cache: CacheSettings) -> tuple[list[list[int]], ChatSession]:
    session = ChatSession(loaded, cache=cache)
    replies = [session.send(p, SamplingSettings(max_new_tokens=32)).tokens for p in PROMPTS]
    session.close()
    return replies, session


@pytest.mark.slow
def test_smollm2_quantized_bounded_equals_unbounded(smollm2_quantized) -> None:
    assert smollm2_quantized.weights_mode in ("int8", "int4")
    ref, _ = _three_turns(smollm2_quantized, CacheSettings(kind="standard"))
    ours, session = _three_turns(smollm2_quantized, CacheSettings(hot_window=8, prefill_chunk=32))
    assert ours == ref
    stats = session.cache.stats  # auto: K/V read back from disk (residual: recomputed)
    assert stats.disk_read_bytes > 0 or stats.recomputed_tokens > 0


@pytest.mark.slow
def test_smollm2_quantized_decode_equals_transformers_generate(smollm2_quantized) -> None:
    """kvchat's loop gives transformers' own greedy tokens on the same quantized weights."""
    from kvchat.engine.chat.generate import generate

    loaded = smollm2_quantized
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    ids = prompt["input_ids"][0].tolist()
    with torch.inference_mode():
        out = loaded.model.generate(
            **prompt,
            cache=DynamicCache(config=loaded.model.config),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )
    expected = out[0, len(ids) :].tolist()
    ours = generate(
        loaded.model,
        DynamicCache(config=loaded.model.config),
        ids,
        device=loaded.device,
        settings=SamplingSettings(max_new_tokens=24),
        stop_ids={tok.eos_token_id},
    )
    assert ours.tokens == expected
    assert "Paris" in tok.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_quantized_weights_replay_the_rows_of_many_calls_in_one_projection(
    family, monkeypatch
) -> None:
    """The int8 kernel and kvchat's int4 kernel give a row the same bits in any call, so a
    replay projects a run of residual pieces (a prefill chunk, then decoded rows) in one call
    instead of one call per original forward call, and the logits stay the standard cache's.
    Float weights (a GEMM whose sums may follow the row count) keep the original calls."""
    from kvchat.engine.kvdirect.arch import ArchAdapter
    from kvchat.engine.models import int4_kernel

    if os.environ.get("KVCHAT_TEST_DEVICE", "cpu") != "cpu" or not int4_kernel.available():
        pytest.skip("int4 runs another kernel here (no C compiler, or not the CPU)")
    calls: dict[str, list[int]] = {}
    original = ArchAdapter.project

    def counting(self, layer_idx, normed):
        calls[mode].append(normed.shape[1])
        return original(self, layer_idx, normed)

    monkeypatch.setattr(ArchAdapter, "project", counting)
    for mode in ("none", "int8", "int4"):
        model = tiny_model(family)
        if mode != "none":
            model = quantize_weights(model, mode)
        independent = ArchAdapter(model).projects_rows_independently(0)
        assert independent == (mode != "none")
        ref_tokens, ref_logits = converse(model, DynamicCache(config=model.config))
        calls[mode] = []
        cache = kvdirect(model, 4)
        tokens, logits = converse(model, cache)
        cache.detach()
        assert cache.stats.recomputed_tokens > 0
        assert tokens == ref_tokens
        assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits)), mode
    assert max(calls["none"]) <= CHUNK_ROWS  # never more rows than one original call
    for mode in ("int8", "int4"):
        assert max(calls[mode]) > CHUNK_ROWS, mode  # several calls' rows at once
        assert len(calls[mode]) * 5 < len(calls["none"]), mode
