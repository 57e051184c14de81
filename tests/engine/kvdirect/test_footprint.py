"""Bytes-per-token figures (docs/facts.md, section 1) and the inspect report.

Expected values are written out as arithmetic on the public config numbers, not computed by
the code under test. The standard-cache definition is checked against transformers' own
DynamicCache.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvchat.engine.kvdirect.footprint import (
    LayerFootprint,
    ModelFootprint,
    bundled_aliases,
    footprint_from_config,
    load_config,
)
from kvchat.engine.kvdirect.inspect_report import inspect_as_dict, render_inspect
from kvchat.errors import ModelNotFoundError

KiB = 1024

ALIASES = [
    "gemma-3-4b",
    "gemma-3-1b",
    "gemma-3-270m",
    "smollm2-135m",
    "smollm2-360m",
    "qwen2.5-0.5b",
    "llama-3.2-1b",
    "phi-3-mini",
    "gpt2",
]

# alias: (hidden, layers, kv_heads, head_dim, sliding layers, window,
#         residual/layer, K+V/layer, K+V all layers)   -- bf16, docs/facts.md section 1
TABLE = {
    "gemma-3-4b": (2560, 34, 4, 256, 29, 1024, 5 * KiB, 4 * KiB, 136 * KiB),
    "gemma-3-1b": (1152, 26, 1, 256, 22, 512, 1152 * 2, 2 * 1 * 256 * 2, 26 * 1 * KiB),
    "gemma-3-270m": (640, 18, 1, 256, 15, 512, 1.25 * KiB, 1 * KiB, 18 * KiB),
    "smollm2-135m": (576, 30, 3, 64, 0, None, 1.125 * KiB, 0.75 * KiB, 22.5 * KiB),
    "smollm2-360m": (960, 32, 5, 64, 0, None, 960 * 2, 2 * 5 * 64 * 2, 32 * 1280),
    "qwen2.5-0.5b": (896, 24, 2, 64, 0, None, 1.75 * KiB, 0.5 * KiB, 12 * KiB),
    "llama-3.2-1b": (2048, 16, 8, 64, 0, None, 4 * KiB, 2 * KiB, 32 * KiB),
    # Phi-3-mini-4k's config sets sliding_window=2047, so DynamicCache windows every layer.
    "phi-3-mini": (3072, 32, 32, 96, 32, 2047, 6 * KiB, 12 * KiB, 384 * KiB),
    "gpt2": (768, 12, 12, 64, 0, None, 1.5 * KiB, 3 * KiB, 36 * KiB),
}


def fp_of(alias: str, dtype: str = "bfloat16") -> ModelFootprint:
    return footprint_from_config(load_config(alias), dtype=dtype)


def test_import_does_not_pull_torch():
    code = (
        "import sys, kvchat.engine.kvdirect.footprint, kvchat.engine.kvdirect.inspect_report;"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bundled_aliases_are_the_documented_ones():
    assert sorted(ALIASES) == bundled_aliases()


@pytest.mark.parametrize("alias", ALIASES)
def test_bundled_config_matches_design_table(alias):
    hidden, n_layers, kv_heads, head_dim, n_sliding, window, res, kv, kv_all = TABLE[alias]
    fp = fp_of(alias)
    assert fp.dtype == "bfloat16" and fp.itemsize == 2
    assert fp.num_layers == n_layers
    assert {(ly.hidden_size, ly.kv_heads, ly.head_dim) for ly in fp.layers} == {
        (hidden, kv_heads, head_dim)
    }
    assert len(fp.sliding_layers) == n_sliding
    assert {ly.sliding_window for ly in fp.sliding_layers} == ({window} if n_sliding else set())
    assert {ly.residual_bytes for ly in fp.layers} == {res}
    assert {ly.kv_bytes for ly in fp.layers} == {kv}
    assert fp.kv_bytes_per_token() == kv_all
    assert fp.residual_bytes_per_token() == n_layers * res


def test_bundled_configs_load_as_real_transformers_configs():
    for alias in ALIASES:
        cfg = load_config(alias)
        assert cfg.name_or_path, alias  # the source repo is recorded
        assert cfg.get_text_config(decoder=True).num_hidden_layers == TABLE[alias][1]


def test_smollm2_135m_by_hand():
    fp = fp_of("smollm2-135m")
    layer = fp.layers[0]
    assert layer.kind == "full_attention" and layer.sliding_window is None
    assert layer.kv_bytes == 2 * 3 * 64 * 2 == 768
    assert layer.residual_bytes == 576 * 2 == 1152
    assert layer.smaller_exact_form == "kv"
    assert fp.kv_bytes_per_token() == 30 * 768 == 23040
    assert fp.residual_bytes_per_token() == 30 * 1152 == 34560
    assert fp.cold_bytes_per_token("auto") == 23040
    assert fp.cold_bytes_per_token("residual") == 34560
    assert fp.cold_bytes_per_token("kv") == 23040
    assert fp.standard_cache_bytes(4096) == 4096 * 23040
    assert fp.residual_to_kv_ratio() == 1152 / 768
    # float32 doubles everything
    assert fp_of("smollm2-135m", "float32").kv_bytes_per_token() == 30 * 2 * 3 * 64 * 4


def test_gemma3_270m_by_hand():
    fp = fp_of("gemma-3-270m")
    assert [ly.index for ly in fp.full_layers] == [5, 11, 17]
    assert all(ly.kind == "sliding_attention" for ly in fp.sliding_layers)
    assert {ly.kv_bytes for ly in fp.layers} == {2 * 1 * 256 * 2} == {1024}
    assert {ly.residual_bytes for ly in fp.layers} == {640 * 2} == {1280}
    # 3 full layers hold all 4096 tokens; 15 sliding layers hold window - 1 = 511 tokens
    assert fp.standard_cache_bytes(4096) == (3 * 4096 + 15 * 511) * 1024 == 20_431_872
    # inside the window every layer holds every token
    assert fp.standard_cache_bytes(100) == 18 * 100 * 1024
    assert fp.standard_cache_bytes(511) == 18 * 511 * 1024
    assert fp.standard_cache_bytes(512) == (3 * 512 + 15 * 511) * 1024
    assert fp.kv_bytes_per_token_past_window() == 3 * 1024
    assert fp.cold_bytes_per_token("auto", past_window=True) == 3 * 1024


def test_gemma3_4b_by_hand():
    fp = fp_of("gemma-3-4b")
    assert fp.kv_bytes_per_token() == 34 * 2 * 4 * 256 * 2 == 136 * KiB
    assert fp.residual_bytes_per_token() == 34 * 2560 * 2 == 170 * KiB
    assert [ly.index for ly in fp.full_layers] == [5, 11, 17, 23, 29]
    assert fp.kv_bytes_per_token_past_window() == 5 * 4 * KiB == 20 * KiB
    # past the 1024 window: 5 full layers x 4096 tokens + 29 sliding layers x 1023 tokens
    assert fp.standard_cache_bytes(4096) == (5 * 4096 + 29 * 1023) * 4 * KiB
    # each token past the window adds only the full layers' K+V
    assert fp.standard_cache_bytes(5000) - fp.standard_cache_bytes(4999) == 20 * KiB
    # the paper's headline: all layers' K+V vs ONE layer's residual
    assert fp.headline_ratio() == (136 * KiB) / (5 * KiB)


@pytest.mark.parametrize(
    "alias, kv_layer, res_layer, n_layers",
    [("gpt2", 2 * 12 * 64 * 2, 768 * 2, 12), ("phi-3-mini", 2 * 32 * 96 * 2, 3072 * 2, 32)],
)
def test_mha_models_prefer_the_residual(alias, kv_layer, res_layer, n_layers):
    fp = fp_of(alias)
    assert {ly.kv_bytes for ly in fp.layers} == {kv_layer}
    assert {ly.residual_bytes for ly in fp.layers} == {res_layer}
    assert {ly.smaller_exact_form for ly in fp.layers} == {"residual"}
    assert fp.cold_bytes_per_token("auto") == n_layers * res_layer
    assert fp.residual_to_kv_ratio() == 0.5


def test_gpt2_literals():
    fp = fp_of("gpt2")
    assert fp.layers[0].kv_bytes == 3072
    assert fp.layers[0].residual_bytes == 1536
    assert fp.kv_bytes_per_token() == 36 * KiB


def test_phi3_mini_standard_cache_is_windowed():
    fp = fp_of("phi-3-mini")
    assert fp.standard_cache_bytes(4096) == 32 * 2046 * 12 * KiB
    assert fp.kv_bytes_per_token_past_window() == 0


def test_tie_prefers_kv_and_forms():
    layer = LayerFootprint(0, "full_attention", None, 2, 64, 256, 512, 512)
    assert layer.smaller_exact_form == "kv"
    fp = ModelFootprint("x", [layer, layer], "bfloat16", 2)
    assert isinstance(fp.layers, tuple)
    assert fp.counts_by_form() == {"residual": 0, "kv": 2}
    with pytest.raises(ValueError):
        fp.cold_bytes_per_token("tokens")


def test_dtype_spellings():
    cfg = load_config("gemma-3-4b")
    assert footprint_from_config(cfg, dtype=None).dtype == "bfloat16"  # the config's own
    assert footprint_from_config(cfg, dtype="torch.float16").itemsize == 2
    assert footprint_from_config(cfg, dtype="fp32").dtype == "float32"


def test_unknown_dtype_rejected():
    with pytest.raises(ValueError):
        footprint_from_config(load_config("gpt2"), dtype="int3")


# -- agreement with transformers' DynamicCache -------------------------------------------------


def _tiny_gemma3_text(**overrides):
    from transformers import Gemma3TextConfig

    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=7,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
    )
    kw.update(overrides)
    return Gemma3TextConfig(**kw)


def _fill_and_check(cfg, fp, chunks, dtype):
    """Feed K/V in ``chunks`` like a model would; compare our figures after every update."""
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache(config=cfg)
    assert len(cache.layers) == fp.num_layers
    for layer, ours in zip(cache.layers, fp.layers, strict=True):
        assert isinstance(layer, DynamicSlidingWindowLayer) == ours.is_sliding
        assert getattr(layer, "sliding_window", None) == ours.sliding_window
    n = 0
    for chunk in chunks:
        n += chunk
        for idx, ours in enumerate(fp.layers):
            shape = (1, ours.kv_heads, chunk, ours.head_dim)
            k = torch.randn(shape, dtype=dtype)
            cache.update(k, torch.randn_like(k), idx)
        held = sum(ly.keys.nbytes + ly.values.nbytes for ly in cache.layers)
        resident = sum(
            ly.keys.untyped_storage().nbytes() + ly.values.untyped_storage().nbytes()
            for ly in cache.layers
        )
        assert fp.standard_cache_bytes(n) == held, (chunks, n)
        assert fp.standard_cache_resident_bytes(n, last_update=chunk) == resident, (chunks, n)
    return n


@pytest.mark.parametrize("chunks", [[20], [13] + [1] * 7, [5, 5, 5, 1, 1, 1, 1, 1], [3, 9, 8]])
def test_standard_cache_matches_dynamic_cache_gemma3(chunks):
    import torch

    cfg = _tiny_gemma3_text()
    fp = footprint_from_config(cfg, dtype="bfloat16")
    assert [ly.kind for ly in fp.layers] == ["sliding_attention"] * 5 + [
        "full_attention",
        "sliding_attention",
    ]
    assert _fill_and_check(cfg, fp, chunks, torch.bfloat16) == 20
    # by hand: 1 full layer x 20 tokens + 6 sliding layers x 7 tokens, 2*1*16*2 B per token
    assert fp.standard_cache_bytes(20) == (20 + 6 * 7) * 64


def test_standard_cache_matches_dynamic_cache_float32():
    import torch

    cfg = _tiny_gemma3_text(num_key_value_heads=2)
    fp = footprint_from_config(cfg, dtype="float32")
    _fill_and_check(cfg, fp, [6, 6, 1, 1, 1], torch.float32)


def test_multimodal_gemma3_uses_the_text_config():
    import torch
    from transformers import Gemma3Config

    text = _tiny_gemma3_text()
    cfg = Gemma3Config(text_config=text.to_dict())
    fp = footprint_from_config(cfg)
    assert fp.num_layers == 7 and len(fp.sliding_layers) == 6
    assert {ly.hidden_size for ly in fp.layers} == {32}
    _fill_and_check(cfg, fp, [11, 1, 1], torch.bfloat16)


def test_layer_kinds_match_dynamic_cache_for_other_families():
    import torch
    from transformers import AutoConfig

    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, vocab_size=64)
    configs = [
        AutoConfig.for_model(
            "mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=6, **tiny
        ),
        AutoConfig.for_model(
            "qwen2",
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=False,
            sliding_window=6,
            **tiny,
        ),
        AutoConfig.for_model(
            "qwen2",
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=2,
            **tiny,
        ),
        AutoConfig.for_model("gpt2", n_embd=32, n_head=4, n_layer=3, vocab_size=64),
    ]
    sliding = [4, 0, 2, 0]
    for cfg, n_sliding in zip(configs, sliding, strict=True):
        fp = footprint_from_config(cfg, dtype="float32")
        assert len(fp.sliding_layers) == n_sliding, cfg.model_type
        _fill_and_check(cfg, fp, [9, 1, 1], torch.float32)


# -- load_config ----------------------------------------------------------------------------


def test_load_config_local_dir(tmp_path):
    _tiny_gemma3_text().save_pretrained(tmp_path)
    fp = footprint_from_config(load_config(tmp_path))
    assert fp.num_layers == 7
    assert fp.name == str(tmp_path)


def test_load_config_dir_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_config(tmp_path)


def test_load_config_does_not_read_outside_the_bundle():
    with pytest.raises(ModelNotFoundError):
        load_config("../configs/gpt2")


def test_load_config_unknown_spec_names_the_fix():
    with pytest.raises(ModelNotFoundError) as err:
        load_config("nobody-kvchat/no-such-model")
    message = str(err.value)
    assert "\n" not in message
    assert "gemma-3-4b" in message and "local model directory" in message


def test_load_config_source_repo_falls_back_to_snapshot():
    # Offline and not cached here: the bundled snapshot of its source answers.
    # (Where the real config is cached, that one loads; its figures are the same.)
    fp = footprint_from_config(load_config("google/gemma-3-4b-it"))
    assert fp.kv_bytes_per_token() == 136 * KiB


# -- report -------------------------------------------------------------------------------------


def test_render_inspect_gemma3_4b_totals():
    text = render_inspect(fp_of("gemma-3-4b"), n_tokens=4096)
    assert "139,264 B" in text  # K+V, all layers, per token (136 KiB)
    assert "174,080 B" in text  # residual, all layers (170 KiB)
    assert "20,480 B" in text  # past the window
    assert f"{(5 * 4096 + 29 * 1023) * 4096:,} B" in text  # standard cache at 4096
    assert f"{5 * 4096 + 29 * 1023:,} B" in text  # ... per token
    assert "136 KiB" in text and "5 KiB" in text and "27.2x" in text
    assert "Misleading" in text and "ONE layer" in text
    assert "keep the last 1,023 tokens" in text
    # 5 sliding : 1 full grouped into runs
    assert "0-4 " in text and "\n5 " in text and "30-33" in text


def test_render_inspect_smollm2_groups_layers():
    text = render_inspect(fp_of("smollm2-135m"), n_tokens=1000)
    assert "0-29" in text
    assert "23,040 B" in text and "34,560 B" in text
    assert f"{1000 * 23040:,} B" in text
    assert "never smaller" in text


def test_render_inspect_gpt2_says_residual_smaller():
    text = render_inspect(fp_of("gpt2"))
    assert "residual" in text.splitlines()[4]  # the 0-11 row's smaller form
    assert "smaller than K+V at every layer" in text
    assert "18,432 B" in text and "36,864 B" in text


@pytest.mark.parametrize("alias", ALIASES)
def test_render_inspect_fits_80_columns(alias):
    text = render_inspect(fp_of(alias))
    assert max(len(line) for line in text.splitlines()) <= 80


def test_inspect_as_dict_keeps_per_layer_rows():
    d = inspect_as_dict(fp_of("gemma-3-270m"), n_tokens=4096)
    json.dumps(d)
    assert len(d["layers"]) == 18
    assert d["layers"][5]["kind"] == "full_attention"
    assert d["layers"][0]["sliding_window"] == 512
    assert d["layers"][0]["standard_cache_tokens"] == 511
    assert d["layers"][5]["standard_cache_tokens"] == 4096
    assert d["per_token"]["kv_all_layers"] == 18 * 1024
    assert d["per_token"]["residual_all_layers"] == 18 * 1280
    assert d["standard_cache"]["bytes"] == (3 * 4096 + 15 * 511) * 1024
    assert d["ratios"]["headline_misleading"]["ratio"] == (18 * 1024) / 1280
