"""``--kv-dtype bfloat16``: a float32 model's K/V held in bfloat16, by both caches alike.

Each K/V row is rounded once, where it enters the cache or is recomputed from a residual
checkpoint, so a ceiling still changes no bit: every hot window, form and ceiling gives the
logits of the standard cache holding bfloat16 K/V. A conversation keeps the dtype it was
saved with.
"""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.chat.conversation import open_session
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings, kv_dtype_for
from kvchat.engine.kvdirect.arch import ArchAdapter
from kvchat.engine.kvdirect.cache import KVDirectCache
from kvchat.engine.kvdirect.footprint import footprint_from_config
from kvchat.engine.kvdirect.standard import StandardCache
from kvchat.errors import KvchatError
from kvchat.lab.tiny_models import FAMILIES
from tests.engine.kvdirect.test_cache_exact import run_conversation, tiny_model
from tests.engine.kvdirect.test_exact_ceilings import ROWS, converse

BF16 = "bfloat16"


def test_the_kv_dtype_resolves_to_the_model_dtype_or_narrower():
    assert kv_dtype_for("auto", "float32") == "float32"
    assert kv_dtype_for("auto", "bfloat16") == "bfloat16"
    assert kv_dtype_for("bfloat16", "float32") == "bfloat16"
    assert kv_dtype_for("float32", "float32") == "float32"
    assert kv_dtype_for("bfloat16", "bfloat16") == "bfloat16"
    with pytest.raises(KvchatError, match="use --kv-dtype auto"):
        kv_dtype_for("float32", "bfloat16")  # wider than the model computes
    with pytest.raises(KvchatError, match="unknown K/V dtype"):
        kv_dtype_for("int8", "float32")


def test_bfloat16_kv_halves_the_kv_bytes_not_the_residuals():
    model = tiny_model("llama")
    full = footprint_from_config(model.config, "float32")
    half = full.with_kv_dtype(BF16)
    assert half.kv_dtype == BF16 and half.dtype == "float32"
    assert half.kv_bytes_per_token() * 2 == full.kv_bytes_per_token()
    assert half.residual_bytes_per_token() == full.residual_bytes_per_token()
    assert half.standard_cache_bytes(100) * 2 == full.standard_cache_bytes(100)
    assert full.with_kv_dtype("float32") is full


# Llama and Gemma 3 (sliding layers, q/k norms) in the fast loop, every family in the suite.
FAST_FAMILIES = ("llama", "gemma3")


@pytest.mark.parametrize(
    "family",
    [f if f in FAST_FAMILIES else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES],
)
def test_every_window_and_form_equals_the_standard_cache_in_bfloat16(family):
    model = tiny_model(family)
    full = footprint_from_config(model.config, "float32")
    standard = StandardCache(model.config, full.with_kv_dtype(BF16), None)
    ref_tokens, ref_logits = run_conversation(model, standard)
    assert standard.layers[0].keys.dtype == torch.bfloat16
    _, float_logits = run_conversation(model, StandardCache(model.config, full, None))
    # The option does something: rounding the K/V moves the logits.
    assert any(not torch.equal(a, b) for a, b in zip(ref_logits, float_logits))
    adapter = ArchAdapter(model)
    for form, hot in (("residual", 1), ("residual", 16), ("kv", 4), ("kv", None)):
        cache = KVDirectCache(adapter, [form] * adapter.num_layers, hot, kv_dtype=BF16)
        cache.attach()
        try:
            tokens, logits = run_conversation(model, cache)
            assert all(layer.keys.dtype == torch.bfloat16 for layer in cache.layers)
        finally:
            cache.close()
        assert tokens == ref_tokens, f"{form}, hot window {hot}"
        for i, (a, b) in enumerate(zip(logits, ref_logits)):
            assert torch.equal(a, b), f"{form}, hot window {hot}: call {i} differs"


@pytest.mark.slow
@pytest.mark.parametrize("smollm2_quantized", ["int4"], indirect=True)
def test_default_model_in_bfloat16_kv_at_every_ceiling(smollm2_quantized, tmp_path, monkeypatch):
    """The exactness matrix's chat (three turns, ~600 tokens) with bfloat16 K/V: the standard
    cache, the unbounded cache and ceilings that stream attention, read K/V back and replay
    residuals all give the same logits at every forward call."""
    loaded = smollm2_quantized
    standard, ref_logits, _ = converse(
        loaded, CacheSettings(kind="standard", kv_dtype=BF16), tmp_path / "s", monkeypatch
    )
    rows = list(ROWS)
    runs = {
        "unbounded": CacheSettings(kv_dtype=BF16),
        "2 MB": CacheSettings(max_mem=2_000_000, kv_dtype=BF16),
        "6 MB": CacheSettings(max_mem=6_000_000, kv_dtype=BF16),
        "4 MB residual": CacheSettings(max_mem=4_000_000, checkpoint="residual", kv_dtype=BF16),
    }
    plans = []
    for name, settings in runs.items():
        tokens, logits, plan = converse(loaded, settings, tmp_path / name, monkeypatch)
        plans.append(plan)
        assert ROWS == rows, f"{name}: forward calls of other sizes"
        assert tokens == standard, f"{name} ({plan}): greedy tokens differ"
        for i, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
            assert torch.equal(a, b), f"{name} ({plan}): forward call {i} differs"
    assert any("streamed" in p for p in plans)
    assert sum(len(t) for t in standard) >= 60


@pytest.mark.slow
@pytest.mark.parametrize("smollm2_quantized", ["int4"], indirect=True)
def test_a_conversation_keeps_its_kv_dtype_when_resumed(smollm2_quantized, tmp_path):
    loaded = smollm2_quantized
    reply = SamplingSettings(max_new_tokens=24)
    prompts = ("What is the capital of France?", "And of Germany?")
    straight = open_session(loaded, data_dir=tmp_path / "a", cache=CacheSettings(kv_dtype=BF16))
    expected = [straight.send(p, reply).tokens for p in prompts]
    straight.close()

    first = open_session(loaded, data_dir=tmp_path / "b", cache=CacheSettings(kv_dtype=BF16))
    assert first.send(prompts[0], reply).tokens == expected[0]
    conversation_id = first.conversation.id
    first.close()
    # Resumed without the option, under a ceiling: the saved bfloat16 K/V and the new rows
    # stay one dtype, and the reply is the uninterrupted run's.
    resumed = open_session(
        loaded, data_dir=tmp_path / "b", cache=CacheSettings(max_mem=1_000_000),
        conversation_id=conversation_id,
    )  # fmt: skip
    try:
        assert resumed.cache_settings.kv_dtype == BF16
        assert resumed.send(prompts[1], reply).tokens == expected[1]
        assert all(layer.keys.dtype == torch.bfloat16 for layer in resumed.cache.layers)
        snapshot = resumed.memory()
        assert snapshot.kv_dtype == BF16
        assert snapshot.standard_equivalent_bytes == resumed.footprint.standard_cache_bytes(
            snapshot.tokens
        )
    finally:
        resumed.close()
