"""The decode step's C++ layers (``kvchat.engine.models.native``) give the Python step's bits: the
same logits and K/V, so bounded still equals unbounded through them."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvchat.engine.models.decode_step import decode_step_for, forget_decode_step
from kvchat.engine.models.native import build
from kvchat.engine.models.native.layers import NativeLayers, serves
from tests.engine.kvdirect.test_cache_exact import run_conversation
from tests.engine.models.test_decode_step import model_in, on_a_residual_cache, same_kv

needs_compiler = pytest.mark.skipif(build.library_path() is None, reason="no C++ compiler")


def native_step(model):
    step = decode_step_for(model)
    assert step is not None and serves(step)
    assert step.wait_for_native(300), "the C++ layers were built but not taken into use"
    return step


def counting(step, kinds=("after_attention", "attended_after_attention")):
    """Count the calls of the C++ layers' second halves (so a test knows they ran): the
    half alone, and the one that calls the attention kernel first."""
    calls = []
    layers = step.native

    def counted(run):
        def call(*args):
            calls.append(args[0])
            return run(*args)

        return call

    for kind in kinds:
        setattr(layers, kind, counted(getattr(layers, kind)))
    return calls


@needs_compiler
@pytest.mark.parametrize("shape", ["smollm2", "gemma3", "qwen2"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_cpp_layers_give_the_python_steps_bits(mode, shape):
    model = model_in(shape, mode, torch.float32)
    step = native_step(model)
    calls = counting(step)
    try:
        cpp_cache = DynamicCache(config=model.config)
        cpp = run_conversation(model, cpp_cache)
        assert len(calls) > len(step.layers)
        step.use_native = False
        py_cache = DynamicCache(config=model.config)
        py = run_conversation(model, py_cache)
    finally:
        forget_decode_step(model)
    assert cpp[0] == py[0]
    assert all(torch.equal(a, b) for a, b in zip(cpp[1], py[1]))
    assert same_kv(cpp_cache, py_cache)


@needs_compiler
@pytest.mark.parametrize("shape", ["smollm2", "gemma3", "qwen2"])
def test_bounded_through_the_cpp_layers_equals_the_standard_cache(shape):
    model = model_in(shape, "int4", torch.float32)
    step = native_step(model)
    calls = counting(step)
    try:
        ref = run_conversation(model, DynamicCache(config=model.config))
        got, recomputed = on_a_residual_cache(model)
    finally:
        forget_decode_step(model)
    assert calls and recomputed > 0
    assert got[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))


@needs_compiler
def test_a_library_that_disagrees_is_not_used(monkeypatch):
    monkeypatch.setattr(NativeLayers, "agrees", lambda self, step: False)
    model = model_in("smollm2", "int4", torch.float32)
    try:
        assert not decode_step_for(model).wait_for_native(300)
        run_conversation(model, DynamicCache(config=model.config))  # the Python step serves
    finally:
        forget_decode_step(model)


@needs_compiler
@pytest.mark.parametrize("shape", ["smollm2", "gemma3"])
def test_the_layers_refuse_more_than_one_token(shape):
    """Their loops read one row and one position's angles: anything else is refused with a
    message, not read past."""
    model = model_in(shape, "int4", torch.float32)
    try:
        layers = native_step(model).native
        width = model.config.hidden_size
        angles = torch.zeros(1, 1, 1, layers.head_dim)
        with torch.inference_mode():
            with pytest.raises(RuntimeError, match="one token per call"):
                layers.before_attention(0, torch.zeros(1, 2, width), angles, angles)
            wide = torch.zeros(1, 1, 2, layers.head_dim)
            with pytest.raises(RuntimeError, match="one position's rotary angles"):
                layers.before_attention(0, torch.zeros(1, 1, width), wide, wide)
            attended = torch.zeros(1, 2, model.config.num_attention_heads * layers.head_dim)
            with pytest.raises(RuntimeError, match="one token per call"):
                layers.after_attention(0, torch.zeros(1, 2, width), attended)
    finally:
        forget_decode_step(model)


def test_float_weights_keep_the_python_step():
    model = model_in("smollm2", "none", torch.float32)
    step = decode_step_for(model)
    assert not serves(step)
    assert not step.wait_for_native(1) and step.native is None


def test_without_the_library_the_step_runs_in_python(monkeypatch):
    monkeypatch.setenv("KVCHAT_NATIVE", "0")
    model = model_in("smollm2", "int4", torch.float32)
    try:
        step = decode_step_for(model)
        assert not step.wait_for_native(1)
        tokens = run_conversation(model, DynamicCache(config=model.config))[0]
    finally:
        forget_decode_step(model)
    assert tokens


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
def test_real_models_decode_the_same_through_the_cpp_layers(name):
    from kvchat.engine.models.load import load
    from kvchat.engine.models.resolve import resolve_model

    model = load(str(resolve_model(name).path), device="cpu", dtype="float32").model
    step = native_step(model)
    calls = counting(step)
    kwargs = {"turn_lengths": (60, 9), "new_per_turn": 12}
    try:
        cpp = run_conversation(model, DynamicCache(config=model.config), **kwargs)
        step.use_native = False
        py = run_conversation(model, DynamicCache(config=model.config), **kwargs)
    finally:
        forget_decode_step(model)
    assert calls
    assert cpp[0] == py[0]
    assert all(torch.equal(a, b) for a, b in zip(cpp[1], py[1]))


@needs_compiler
@pytest.mark.parametrize("shape", ["smollm2", "gemma3"])
def test_decode_steps_call_the_attention_kernel_from_the_cpp_half(shape):
    """Every layer of a decode step on the standard cache calls the attention kernel from
    the C++ half (no Python attention call in between); the bits are the Python step's
    (the test above)."""
    model = model_in(shape, "int4", torch.float32)
    step = native_step(model)
    assert step.native.attention_kernel != 0
    calls = counting(step, kinds=("attended_after_attention",))
    try:
        run_conversation(model, DynamicCache(config=model.config))
    finally:
        forget_decode_step(model)
    steps = len(calls) // len(step.layers)
    assert steps > 30 and len(calls) == steps * len(step.layers)


@needs_compiler
def test_an_attended_half_that_disagrees_leaves_attention_to_python(monkeypatch):
    """If the attended half's bits differ from the exact kernel's called from Python, only
    that half is given up: the C++ halves still serve, and attention runs from Python."""
    monkeypatch.setattr(NativeLayers, "attends_alike", lambda self, *args: False)
    model = model_in("smollm2", "int4", torch.float32)
    step = native_step(model)
    assert step.native.attention_kernel == 0
    attended = counting(step, kinds=("attended_after_attention",))
    halves = counting(step, kinds=("after_attention",))
    try:
        run_conversation(model, DynamicCache(config=model.config))
    finally:
        forget_decode_step(model)
    assert not attended and len(halves) > len(step.layers)
