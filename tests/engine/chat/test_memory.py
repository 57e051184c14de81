"""Accounting: the snapshot equals the bytes actually held, and RSS stays under the ceiling."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import torch

from kvchat.engine.chat.generate import generate
from kvchat.engine.chat.memory import format_memory_line, process_rss
from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings

pytestmark = pytest.mark.slow

# What RSS may grow by beyond --max-mem: activations of one prefill chunk, the logits, the
# attention scores of one layer, and allocator slack. Documented in README.md.
RSS_ALLOWANCE = 96 * 2**20


def storage_bytes_held(cache) -> int:
    """Bytes of every distinct storage the cache references, found by walking it."""
    seen: dict[int, int] = {}
    for layer in cache.layers:
        tensors = [layer.keys, layer.values] + [p.resident for p in layer.store.pieces]
        for t in tensors:
            if t is not None and t.numel():
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def scratch_storages_held(cache) -> int:
    """Bytes of every tensor storage reachable from the cache's own objects (not the model's
    modules) that is neither hot K/V nor a checkpoint: the scratch it keeps between calls,
    found by walking what the objects hold, not by asking the engine."""
    state = set()
    for layer in cache.layers:
        for t in [layer.keys, layer.values] + [p.resident for p in layer.store.pieces]:
            if t is not None and t.numel():
                state.add(t.untyped_storage().data_ptr())
    seen: dict[int, int] = {}
    visited: set[int] = set()
    todo: list = [cache]
    while todo:
        obj = todo.pop()
        if id(obj) in visited or isinstance(obj, torch.nn.Module):
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.numel():
                storage = obj.untyped_storage()
                if storage.data_ptr() not in state:
                    seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            todo += list(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo += list(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("kvchat"):
            todo += list(vars(obj).values())
    return sum(seen.values())


def test_snapshot_matches_the_tensor_bytes_held(smollm2_loaded):
    settings = CacheSettings(max_mem=12 * 2**20, prefill_chunk=64, checkpoint="residual")
    session = ChatSession(smollm2_loaded, cache=settings)
    for prompt in ("Tell me about the moon.", "And the sun?"):
        session.send(prompt, SamplingSettings(max_new_tokens=40))
    mem = session.memory()
    assert mem.hot_kv_bytes + mem.checkpoint_bytes == storage_bytes_held(session.cache)
    assert mem.token_id_bytes == 8 * len(session.token_ids)
    assert mem.state_bytes <= 12 * 2**20
    assert mem.tokens == mem.hot_tokens + mem.checkpointed_tokens
    assert 0 < mem.checkpointed_tokens and mem.recompute_seconds > 0
    # Scratch kept between calls (buffers reused by every layer), found by walking the
    # cache's objects, is within what the snapshot reports; and it stays within one layer's
    # worth: its recomputed K/V plus the copy for attention.
    held = scratch_storages_held(session.cache)
    assert 0 < held <= mem.scratch_peak_bytes
    one_layer = 2 * mem.tokens * smollm2_loaded.footprint.layers[0].kv_bytes
    assert mem.scratch_peak_bytes <= one_layer
    line = format_memory_line(mem)
    assert "standard cache" in line and "hot" in line and "recompute" in line


def test_rss_growth_stays_within_the_ceiling_plus_allowance(smollm2_loaded):
    ceiling = 8 * 2**20  # K/V form (auto): ~180 tokens fit, 250 are generated
    session = ChatSession(smollm2_loaded, cache=CacheSettings(max_mem=ceiling))
    session.send("Hello!", SamplingSettings(max_new_tokens=8))  # warm up the allocator
    on_cuda = session.loaded.device.type == "cuda"
    if on_cuda:  # device memory is what the ceiling bounds there
        torch.cuda.reset_peak_memory_stats()
        cuda_baseline = torch.cuda.memory_allocated()
    baseline = process_rss()
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        proc = psutil.Process()
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        prompt = session.loaded.tokenizer("Once upon a time, " * 20)["input_ids"]
        outcome = generate(
            session.loaded.model,
            session.cache,
            prompt,
            device=session.loaded.device,
            settings=SamplingSettings(max_new_tokens=250),
            stop_ids=set(),
        )
    finally:
        done.set()
        sampler.join()
    mem = session.memory()
    assert len(outcome.tokens) == 250
    assert mem.checkpointed_tokens > 0, "the ceiling never forced an eviction"
    assert mem.state_bytes <= ceiling
    assert peak - baseline <= ceiling + RSS_ALLOWANCE, (
        f"RSS grew {(peak - baseline) / 2**20:.1f} MiB"
    )
    if on_cuda:
        grew = torch.cuda.max_memory_allocated() - cuda_baseline
        assert grew <= ceiling + RSS_ALLOWANCE, f"device memory grew {grew / 2**20:.1f} MiB"


def test_a_bf16_model_keeps_its_state_in_bf16_like_the_standard_cache(smollm2_bf16_default):
    """A bf16 checkpoint under the defaults keeps K/V and residual checkpoints in bf16: the
    bytes held equal what transformers' own DynamicCache holds for the same tokens (counted
    from its tensors, not from kvchat's accounting), and checkpoints are bf16 tensors."""
    loaded = smollm2_bf16_default
    prompts = ("Tell me about the moon.", "And the sun?")
    reply = SamplingSettings(max_new_tokens=30)
    standard = ChatSession(loaded, cache=CacheSettings(kind="standard"))
    for prompt in prompts:
        standard.send(prompt, reply)
    dynamic_bytes = sum(
        t.numel() * t.element_size()
        for layer in standard.cache.layers
        for t in (layer.keys, layer.values)
    )
    assert {layer.keys.dtype for layer in standard.cache.layers} == {torch.bfloat16}
    standard.close()

    unbounded = ChatSession(loaded, cache=CacheSettings())
    for prompt in prompts:
        unbounded.send(prompt, reply)
    assert unbounded.memory().hot_kv_bytes == dynamic_bytes
    unbounded.close()

    bounded = ChatSession(loaded, cache=CacheSettings(max_mem=2 * 2**20, checkpoint="residual"))
    for prompt in prompts:
        bounded.send(prompt, reply)
    mem = bounded.memory()
    assert mem.checkpointed_tokens > 0
    assert mem.hot_kv_bytes + mem.checkpoint_bytes == storage_bytes_held(bounded.cache)
    held = {
        t.dtype
        for layer in bounded.cache.layers
        for t in [layer.keys, layer.values] + [p.resident for p in layer.store.pieces]
        if t is not None and t.numel()
    }
    bounded.close()
    assert held == {torch.bfloat16}, held


def test_bf16_kv_holds_half_the_bytes_and_keeps_residuals_in_float32(smollm2_loaded):
    """``--kv-dtype bfloat16`` on a float32 model: the K/V tensors held (counted from the
    tensors, not from kvchat's accounting) are half the float32 run's for the same tokens,
    the standard cache it is compared with holds as much, and residual checkpoints stay
    float32 (the residual stream's dtype)."""
    prompts = ("Tell me about the moon.", "And the sun?")
    reply = SamplingSettings(max_new_tokens=30)
    held = {}
    for kv_dtype in ("auto", "bfloat16"):
        session = ChatSession(smollm2_loaded, cache=CacheSettings(kv_dtype=kv_dtype))
        for prompt in prompts:
            session.send(prompt, reply)
        held[kv_dtype] = storage_bytes_held(session.cache)
        mem = session.memory()
        assert mem.standard_equivalent_bytes == mem.hot_kv_bytes == held[kv_dtype]
        line = format_memory_line(mem)
        session.close()
    assert held["bfloat16"] * 2 == held["auto"]
    assert mem.kv_dtype == "bfloat16" and "K/V in bfloat16" in line

    settings = CacheSettings(max_mem=2 * 2**20, checkpoint="residual", kv_dtype="bfloat16")
    bounded = ChatSession(smollm2_loaded, cache=settings)
    for prompt in prompts:
        bounded.send(prompt, reply)
    assert bounded.memory().checkpointed_tokens > 0
    kv = {t.dtype for layer in bounded.cache.layers for t in (layer.keys, layer.values)}
    residuals = {
        p.resident.dtype
        for layer in bounded.cache.layers
        for p in layer.store.pieces
        if p.resident is not None
    }
    bounded.close()
    assert kv == {torch.bfloat16} and residuals == {torch.float32}
