"""The growing hot window: rows copied into a reserve, not concatenated.

With no ceiling, against the standard cache on every tiny family: the same logits bit for
bit, the same K/V, no new storage per decode step while the reserve lasts (a sliding layer's
window moves through its reserve), and after ``release_reserve`` (what a session does after
each reply) exactly the bytes the standard cache holds. Under the disk tier, a K/V-form
window moves through the reserve the plan counts while the cold rows are read in place and
folded apart, with the same bits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvchat.engine.chat.generate import forward, prefill
from kvchat.engine.kvdirect.arch import ArchAdapter
from kvchat.engine.kvdirect.cache import KVDirectCache
from kvchat.engine.kvdirect.footprint import footprint_from_config
from kvchat.engine.kvdirect.planner import GROWTH_RESERVE_ROWS, Planner
from kvchat.lab.tiny_models import FAMILIES
from tests.engine.kvdirect.test_cache_exact import run_conversation, tiny_model
from tests.engine.kvdirect.test_tiers import tiered_cache


def growing_cache(model, form: str = "kv") -> KVDirectCache:
    adapter = ArchAdapter(model)
    cache = KVDirectCache(adapter, [form] * adapter.num_layers)
    cache.hot_reserve = GROWTH_RESERVE_ROWS
    return cache.attach()


def standard_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@pytest.mark.parametrize("form", ["kv", "residual"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_growing_window_gives_the_standard_cache_bits(family, form):
    model = tiny_model(family)
    standard = DynamicCache(config=model.config)
    ref_tokens, ref_logits = run_conversation(model, standard)
    cache = growing_cache(model, form)
    tokens, logits = run_conversation(model, cache)
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    for mine, ref in zip(cache.layers, standard.layers):
        assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
    if form == "residual":  # hot or not, every token of a full layer keeps its checkpoint
        for layer in cache.layers:
            if not layer.is_sliding:
                assert (layer.store.start, layer.store.end) == (0, layer.cumulative_length)
                assert {p.form for p in layer.store.pieces} == {"residual"}
    if family in ("llama", "qwen2"):  # full attention everywhere: every layer grows
        assert cache.hot_bytes() > standard_bytes(standard)
    cache.release_reserve()
    assert cache.hot_bytes() == standard_bytes(standard)
    for layer in cache.layers:
        assert layer.keys.is_contiguous() and layer.values.is_contiguous()
    cache.close()


def test_decode_steps_write_into_the_reserve_without_new_storage():
    model = tiny_model("llama")
    cache = growing_cache(model)
    with torch.inference_mode():
        logits = prefill(model, cache, list(range(5, 45)), torch.device("cpu"), 16)
        layer = cache.layers[0]
        storage = layer.keys.untyped_storage().data_ptr()
        for _ in range(GROWTH_RESERVE_ROWS // 2):
            logits = forward(model, cache, [int(logits.argmax())], torch.device("cpu"))
            assert layer.keys.untyped_storage().data_ptr() == storage
        assert layer.hot_length == 40 + GROWTH_RESERVE_ROWS // 2
        for _ in range(GROWTH_RESERVE_ROWS):  # past the reserve: a bigger one, rows kept
            logits = forward(model, cache, [int(logits.argmax())], torch.device("cpu"))
        assert layer.hot_length == 40 + GROWTH_RESERVE_ROWS // 2 + GROWTH_RESERVE_ROWS
    cache.close()


def test_under_a_ceiling_that_holds_everything_decode_steps_use_the_reserve():
    """A planner whose ceiling holds every token gives the windows their reserve: decode
    steps write into it (no new storage), the state stays under the ceiling, and the
    logits are the standard cache's. Once the ceiling no longer holds the reserve, the
    windows are compact again."""
    model = tiny_model("llama")
    adapter = ArchAdapter(model)
    fp = footprint_from_config(model.config, "float32")
    forms = ["kv"] * adapter.num_layers
    ids = list(range(5, 45))
    per_row = sum(layer.kv_bytes for layer in fp.layers)
    ceiling = (96 + GROWTH_RESERVE_ROWS) * per_row + 4096  # the reserve fits up to 96 tokens
    cache = KVDirectCache(adapter, forms, None, Planner(fp, forms, ceiling, 16)).attach()
    standard = DynamicCache(config=model.config)
    with torch.inference_mode():
        ref = prefill(model, standard, ids, torch.device("cpu"), 16)
        logits = prefill(model, cache, ids, torch.device("cpu"), 16)
        assert torch.equal(logits, ref) and cache.hot_reserve == GROWTH_RESERVE_ROWS
        layer = cache.layers[0]
        storage = layer.keys.untyped_storage().data_ptr()
        for step in range(70):
            token = int(ref.argmax())
            ref = forward(model, standard, [token], torch.device("cpu"))
            logits = forward(model, cache, [token], torch.device("cpu"))
            assert torch.equal(logits, ref), f"step {step}"
            assert cache.resident_bytes() <= ceiling
            if step < 8:
                assert layer.keys.untyped_storage().data_ptr() == storage
        assert cache.hot_reserve == 0 and layer.growth is None  # the reserve no longer fits
    cache.close()


def test_a_sliding_layer_moves_through_its_reserve_past_the_window():
    """Gemma 3's sliding layers (window 24 here) past their window: a decode step writes one
    row and moves the window's view, with no new storage until the reserve is used up, and
    attention sees what the standard cache returns."""
    model = tiny_model("gemma3")
    standard = DynamicCache(config=model.config)
    cache = growing_cache(model)
    window = model.config.sliding_window
    with torch.inference_mode():
        ids = list(range(5, 45))  # past the window already
        ref = prefill(model, standard, ids, torch.device("cpu"), 16)
        logits = prefill(model, cache, ids, torch.device("cpu"), 16)
        layer = cache.layers[0]
        assert layer.is_sliding and layer.hot_length == window - 1
        storage = layer.keys.untyped_storage().data_ptr()
        for step in range(GROWTH_RESERVE_ROWS + 8):
            token = int(ref.argmax())
            ref = forward(model, standard, [token], torch.device("cpu"))
            logits = forward(model, cache, [token], torch.device("cpu"))
            assert torch.equal(logits, ref), f"step {step}"
            assert layer.hot_length == window - 1
            if step < GROWTH_RESERVE_ROWS // 2:
                assert layer.keys.untyped_storage().data_ptr() == storage, f"step {step}"
        for mine, theirs in zip(cache.layers, standard.layers):
            assert torch.equal(mine.keys, theirs.keys[..., -mine.hot_length :, :])
    cache.release_reserve()
    assert layer.keys.untyped_storage().nbytes() == layer.keys.nbytes
    cache.close()


def test_a_window_set_from_outside_is_taken_as_it_is():
    """Resume sets the hot rows directly: the next step grows from those, not from a stale
    reserve."""
    model = tiny_model("llama")
    standard = DynamicCache(config=model.config)
    cache = growing_cache(model)
    with torch.inference_mode():
        ids = list(range(7, 37))
        prefill(model, standard, ids, torch.device("cpu"), 16)
        prefill(model, cache, ids, torch.device("cpu"), 16)
        for mine, ref in zip(cache.layers, standard.layers):
            mine.set_hot(ref.keys.clone(), ref.values.clone())
        a = forward(model, standard, [3], torch.device("cpu"))
        b = forward(model, cache, [3], torch.device("cpu"))
    assert torch.equal(a, b)
    for mine, ref in zip(cache.layers, standard.layers):
        assert torch.equal(mine.keys, ref.keys)
    cache.close()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("reserve", [4, 16])  # 16: the last turn's 10-row call goes apart too
def test_under_the_disk_tier_the_window_moves_through_its_reserve(family, reserve, tmp_path):
    """K/V-form windows of 6 rows with the cold rows on disk, read in place: attention folds
    the cold rows and the window apart, and the logits and K/V are the standard cache's."""
    model = tiny_model(family)
    standard = DynamicCache(config=model.config)
    ref_tokens, ref_logits = run_conversation(model, standard)
    cache = tiered_cache(model, "kv", 6, "spill", tmp_path)
    cache.kv_reserve = reserve
    tokens, logits = run_conversation(model, cache)
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    assert cache.stats.rows_read_in_place > 0
    for mine, ref in zip(cache.layers, standard.layers):
        assert torch.equal(mine.keys, ref.keys[..., -mine.hot_length :, :])
        assert mine.hot_bytes() <= 2 * (6 + 1 + reserve) * mine.keys[..., :1, :].nbytes
    cache.close()


def test_under_the_disk_tier_a_decode_step_copies_no_window(tmp_path):
    """The window's rows stay where they lie while the reserve lasts (before, every step
    copied them next to the cold rows and cloned them back out), then move once."""
    model = tiny_model("llama")
    standard = DynamicCache(config=model.config)
    cache = tiered_cache(model, "kv", 6, "spill", tmp_path)
    cache.kv_reserve = 4
    with torch.inference_mode():
        ids = list(range(5, 45))
        ref = prefill(model, standard, ids, torch.device("cpu"), 16)
        logits = prefill(model, cache, ids, torch.device("cpu"), 16)
        assert torch.equal(logits, ref)
        layer = cache.layers[0]
        storages = []
        for step in range(9):
            token = int(ref.argmax())
            ref = forward(model, standard, [token], torch.device("cpu"))
            logits = forward(model, cache, [token], torch.device("cpu"))
            assert torch.equal(logits, ref), f"step {step}"
            assert layer.hot_length == 6
            storages.append(layer.keys.untyped_storage().data_ptr())
    assert len(set(storages[:5])) == 1 and len(set(storages)) == 2, storages
    assert cache.stats.rows_read_in_place > 0
    cache.close()


def test_an_attention_that_cannot_fold_apart_gets_the_rows_joined(tmp_path):
    """A model in eager attention (the lab's baselines read its weights) never gets the cold
    rows apart: they are joined to the window first, and the logits are those of the cache
    that copies the window next to them."""
    from kvchat.engine.kvdirect.attention import route
    from kvchat.lab.tiny_models import tiny_model as plain_tiny_model

    model = plain_tiny_model("llama", kvchat_attention=False)
    model.set_attn_implementation("eager")
    route(model)
    runs = []
    for reserve in (0, 4):
        cache = tiered_cache(model, "kv", 6, "spill", tmp_path / str(reserve))
        cache.kv_reserve = reserve
        runs.append(run_conversation(model, cache))
        assert cache.stats.rows_read_in_place > 0
        cache.close()
    (tokens, logits), (tokens_apart, logits_apart) = runs
    assert tokens_apart == tokens
    assert all(torch.equal(a, b) for a, b in zip(logits_apart, logits))
