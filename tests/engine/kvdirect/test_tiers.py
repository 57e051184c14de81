"""Every form x tier x hot window against the standard cache, on every tiny family.

Forms: residual (recomputed), kv (read back), auto (per layer). Tiers: cold rows resident,
in spill files, or in saved segments (a conversation resumed from its files). Logits must be
``torch.equal`` on the path that hands attention whole K/V, greedy tokens equal on the
streamed one (tests/engine/kvdirect/test_disk_tier.py covers that).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvchat.engine.kvdirect.arch import ArchAdapter
from kvchat.engine.kvdirect.cache import KVDirectCache
from kvchat.engine.kvdirect.footprint import footprint_from_config
from kvchat.engine.kvdirect.planner import choose_forms
from kvchat.engine.kvdirect.state_store import pack_kv, unpack_kv
from kvchat.lab.tiny_models import FAMILIES
from tests.engine.kvdirect.test_cache_exact import (
    NEW_PER_TURN,
    TURN_LENGTHS,
    run_conversation,
    tiny_model,
)

TOTAL = sum(TURN_LENGTHS) + len(TURN_LENGTHS) * NEW_PER_TURN


def tiered_cache(model, form, window, tier, tmp_path):
    adapter = ArchAdapter(model)
    if form == "auto":
        fp = footprint_from_config(model.config, "float32")
        forms = choose_forms(fp, "auto")
    else:
        forms = [form] * adapter.num_layers
    cache = KVDirectCache(adapter, forms, hot_window=window)
    cache.kv_window = window
    cache.spill_root = tmp_path
    if tier == "spill":
        cache.checkpoint_budget = 0  # every cold row goes to disk as soon as it is cold
    return cache.attach()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("form", ["kv", "residual", "auto"])
def test_every_form_and_tier_matches_the_standard_cache(family, form, tmp_path):
    model = tiny_model(family)
    ref_tokens, ref_logits = run_conversation(model, DynamicCache(config=model.config))
    for tier in ("resident", "spill"):
        for window in (1, 16, TOTAL // 2, None):
            cache = tiered_cache(model, form, window, tier, tmp_path)
            tokens, logits = run_conversation(model, cache)
            read = cache.stats.disk_read_bytes
            in_place = cache.stats.rows_read_in_place
            cache.close()
            where = f"{family} {form} {tier} B={window}"
            assert tokens == ref_tokens, f"{where}: greedy tokens differ"
            assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits)), (
                f"{where}: logits not bit-identical"
            )
            kv_layers = {layer.form for layer in cache.layers} == {"kv"}
            if window is not None and window < 16 and (tier == "spill" or kv_layers):
                assert read > 0, f"{where}: nothing was read back from disk: vacuous"
            if form == "kv" and window is not None and window < 16:
                # attention got strided views of rows read in place, and still the same bits
                assert in_place > 0, f"{where}: the in-place read path was not taken"


def test_packed_kv_rows_round_trip_bit_for_bit():
    keys = torch.randn(1, 3, 7, 5)
    values = torch.randn(1, 3, 7, 5)
    rows = pack_kv(keys, values)
    assert rows.shape == (1, 7, 30)
    k, v = unpack_kv(rows, 3, 5)
    assert torch.equal(k, keys) and torch.equal(v, values)
    # Any run of positions is a contiguous slice of the rows.
    k2, v2 = unpack_kv(rows[:, 2:5].contiguous(), 3, 5)
    assert torch.equal(k2, keys[..., 2:5, :]) and torch.equal(v2, values[..., 2:5, :])


def test_kv_form_with_everything_hot_holds_what_the_standard_cache_holds():
    model = tiny_model("llama")
    standard = DynamicCache(config=model.config)
    run_conversation(model, standard)
    cache = tiered_cache(model, "kv", None, "resident", None)
    run_conversation(model, cache)
    cache.close()
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in standard.layers)
    assert cache.hot_bytes() + cache.checkpoint_bytes() == held
