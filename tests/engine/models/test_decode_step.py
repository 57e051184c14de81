"""The lean decode step (``kvchat.engine.models.decode_step``) gives the model's own bits."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvchat.engine.chat.generate as generate_module
from kvchat.engine.kvdirect.arch import ArchAdapter
from kvchat.engine.kvdirect.cache import KVDirectCache
from kvchat.engine.models.decode_step import decode_step_for, forget_decode_step
from kvchat.engine.models.quantize import quantize_weights
from tests.engine.kvdirect.test_cache_exact import run_conversation, tiny_model
from tests.engine.kvdirect.test_thread_counts import smollm2_shaped

MODES = [
    ("none", torch.float32),
    ("none", torch.bfloat16),
    ("int8", torch.float32),
    ("int4", torch.float32),
]


def model_in(shape: str, mode: str, dtype: torch.dtype):
    if shape in ("tiny", "qwen2", "gemma3"):
        model = tiny_model("llama" if shape == "tiny" else shape, dtype)
    else:
        model = smollm2_shaped().to(dtype)
    return model if mode == "none" else quantize_weights(model, mode)


def on_the_model_path(monkeypatch, model, cache, **kwargs):
    """``run_conversation`` with every call through ``model(...)`` (no decode step)."""
    with monkeypatch.context() as patch:
        patch.setattr(generate_module, "decode_step_for", lambda _model: None)
        return run_conversation(model, cache, **kwargs)


def on_a_residual_cache(model):
    """``run_conversation`` on a KV-Direct cache with residual checkpoints and a hot window
    of 4 (so K/V are replayed), and how many tokens it recomputed."""
    adapter = ArchAdapter(model)
    cache = KVDirectCache(adapter, ["residual"] * adapter.num_layers, 4).attach()
    try:
        return run_conversation(model, cache), cache.stats.recomputed_tokens
    finally:
        cache.detach()


def same_kv(a, b) -> bool:
    return all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
        for x, y in zip(a.layers, b.layers)
    )


@pytest.mark.parametrize(("mode", "dtype"), MODES)
@pytest.mark.parametrize("shape", ["tiny", "qwen2", "gemma3", "smollm2"])
def test_the_step_gives_the_model_forward_bits(monkeypatch, shape, mode, dtype):
    model = model_in(shape, mode, dtype)
    step = decode_step_for(model)
    assert step is not None
    # Bit for bit with attention through the model's own function (float weights use it;
    # quantized ones pack GQA, below).
    step.packs_gqa = False
    try:
        fast_cache = DynamicCache(config=model.config)
        fast = run_conversation(model, fast_cache)
    finally:
        forget_decode_step(model)
    ref_cache = DynamicCache(config=model.config)
    ref = on_the_model_path(monkeypatch, model, ref_cache)
    assert fast[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(fast[1], ref[1]))
    assert same_kv(fast_cache, ref_cache)


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_packed_gqa_steps_are_for_quantized_models_and_agree_closely(monkeypatch, mode):
    model = model_in("smollm2", mode, torch.float32)
    assert decode_step_for(model).packs_gqa == (mode != "none")
    fast = run_conversation(model, DynamicCache(config=model.config))
    ref = on_the_model_path(monkeypatch, model, DynamicCache(config=model.config))
    assert fast[0] == ref[0]
    # Packing sums attention in another order (last-bit differences); the kernels' bf16
    # inputs can turn one of those into a bf16 step (0.4%) of an activation.
    scale = max(b.abs().max().item() for b in ref[1])
    assert all(torch.allclose(a, b, rtol=0, atol=0.02 * scale) for a, b in zip(fast[1], ref[1]))
    if mode == "none":
        assert all(torch.equal(a, b) for a, b in zip(fast[1], ref[1]))


@pytest.mark.parametrize("shape", ["smollm2", "qwen2", "gemma3"])
@pytest.mark.parametrize("mode", ["none", "int4"])
def test_bounded_cache_through_the_step_equals_the_standard_cache(mode, shape):
    # Residual checkpoints taken by the step (note_layer_input), K/V replayed from them on
    # the model's modules: the same bits as the standard cache through the same steps.
    model = model_in(shape, mode, torch.float32)
    ref = run_conversation(model, DynamicCache(config=model.config))
    got, recomputed = on_a_residual_cache(model)
    assert recomputed > 0
    assert got[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))


def test_a_replaced_after_attention_half_runs_and_keeps_bounded_equal_to_standard():
    # What benchmarks/bench_compile.py relies on: the half after attention computes no K/V,
    # so whatever replaces it (there, a compiled one; here, one that shifts its output),
    # residual replays still give the standard cache's bits through the same steps.
    model = model_in("smollm2", "int4", torch.float32)
    step = decode_step_for(model)
    plain = run_conversation(model, DynamicCache(config=model.config))
    calls = []

    def shifted(layer, residual, out):
        calls.append(layer.index)
        return type(step).after_attention(step, layer, residual, out) + 1e-3

    step.after_attention = shifted
    try:
        ref = run_conversation(model, DynamicCache(config=model.config))
        got, recomputed = on_a_residual_cache(model)
    finally:
        forget_decode_step(model)
    assert calls[: len(step.layers)] == list(range(len(step.layers)))
    assert not all(torch.equal(a, b) for a, b in zip(ref[1], plain[1]))
    assert recomputed > 0
    assert got[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["none", "int4"])
def test_the_real_default_model_steps_agree_with_its_forward(monkeypatch, smollm2_dir, weights):
    from kvchat.engine.models.load import load

    model = load(str(smollm2_dir), device="cpu", dtype="float32", weights=weights).model
    assert decode_step_for(model).packs_gqa == (weights == "int4")
    kwargs = {"turn_lengths": (60, 9), "new_per_turn": 12}
    fast = run_conversation(model, DynamicCache(config=model.config), **kwargs)
    ref = on_the_model_path(monkeypatch, model, DynamicCache(config=model.config), **kwargs)
    assert fast[0] == ref[0]
    if weights == "none":
        assert all(torch.equal(a, b) for a, b in zip(fast[1], ref[1]))
    scale = max(b.abs().max().item() for b in ref[1])
    assert all(torch.allclose(a, b, rtol=0, atol=0.02 * scale) for a, b in zip(fast[1], ref[1]))


@pytest.mark.parametrize("family", ["mistral", "phi3", "gpt2"])
def test_other_families_keep_the_model_path(family):
    assert decode_step_for(tiny_model(family)) is None


def test_qwen2_with_sliding_window_layers_keeps_the_model_path():
    model = tiny_model("qwen2")
    assert decode_step_for(model) is not None
    forget_decode_step(model)
    model.config.layer_types = ["sliding_attention"] + model.config.layer_types[1:]
    assert decode_step_for(model) is None


def test_hooks_on_skipped_modules_send_the_step_back_to_the_model_path():
    model = tiny_model("llama")
    assert decode_step_for(model) is not None
    seen = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: seen.append(1))
    assert decode_step_for(model) is None
    handle.remove()
    # The KV-Direct cache's own pre-hooks are handed their input by the step itself.
    adapter = ArchAdapter(model)
    cache = KVDirectCache(adapter, ["residual"] * adapter.num_layers, 4).attach()
    assert decode_step_for(model) is not None
    cache.detach()
    model.train()
    assert decode_step_for(model) is None
    model.eval()


def test_a_step_does_not_keep_its_model_alive():
    import gc
    import weakref

    model = tiny_model("llama")
    assert decode_step_for(model) is not None
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_a_model_whose_layers_were_quantized_gets_a_new_step():
    model = tiny_model("llama")
    before = decode_step_for(model)
    quantize_weights(model, "int8")  # replaces the layers the first step called
    after = decode_step_for(model)
    assert after is not before and after is not None
    assert after.layers[0].gate_up is not None
    forget_decode_step(model)
    assert decode_step_for(model) is not after


@pytest.mark.slow
def test_real_gemma3_270m_steps_give_its_forward_bits_past_the_sliding_window(monkeypatch):
    """Gemma 3 270M as kvchat loads it by default (int4 from its GGUF): the step's logits
    and K/V equal the model's forward at every token, past its 512-token window."""
    from kvchat.engine.models.decode_step import Gemma3DecodeStep
    from kvchat.engine.models.load import load

    model = load("gemma-3-270m", device="cpu", weights="auto").model
    assert isinstance(decode_step_for(model), Gemma3DecodeStep)
    kwargs = {"turn_lengths": (500, 9), "new_per_turn": 12}
    fast_cache = DynamicCache(config=model.config)
    fast = run_conversation(model, fast_cache, **kwargs)
    ref_cache = DynamicCache(config=model.config)
    ref = on_the_model_path(monkeypatch, model, ref_cache, **kwargs)
    assert fast[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(fast[1], ref[1]))
    assert same_kv(fast_cache, ref_cache)
