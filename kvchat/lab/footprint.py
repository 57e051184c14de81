"""Bytes per token per layer against all layers: the arithmetic behind the paper's headline.

No model is loaded: the figures follow from each bundled config (kvchat/engine/kvdirect/configs),
the same ``ModelFootprint`` that ``kvchat inspect`` prints and tests check against a real
``DynamicCache``. The paper's "5 KB vs 136 KB per token" (Gemma 3 4B, bf16) sets ONE layer's
residual against ALL layers' K/V; like for like, a residual checkpoint per layer is smaller
than that layer's K+V only for multi-head (MHA) models.
"""

from __future__ import annotations

from kvchat.lab.context import LabContext
from kvchat.lab.report import Claim, Section, Table


def _kib(n: float) -> float:
    return round(n / 1024, 3)


def run(ctx: LabContext) -> Section:
    from kvchat.engine.kvdirect.footprint import (
        bundled_aliases,
        bundled_config_dict,
        config_from_dict,
        footprint_from_config,
    )

    section = Section(key="footprint", title="Bytes per token: one layer against all layers")
    rows, data = [], {}
    for alias in bundled_aliases():
        fp = footprint_from_config(config_from_dict(bundled_config_dict(alias)), "bfloat16")
        layer = max(fp.layers, key=lambda x: x.residual_bytes)
        kv_per_layer = max(x.kv_bytes for x in fp.layers)
        entry = {
            "layers": fp.num_layers,
            "residual_per_layer": layer.residual_bytes,
            "kv_per_layer": kv_per_layer,
            "residual_all_layers": fp.residual_bytes_per_token(),
            "kv_all_layers": fp.kv_bytes_per_token(),
            "kv_past_window": fp.kv_bytes_per_token_past_window(),
            "headline_ratio": fp.headline_ratio(),
            "like_for_like_ratio": fp.residual_to_kv_ratio(),
            "auto_forms": fp.counts_by_form(),
        }
        data[alias] = entry
        rows.append(
            [
                alias,
                fp.num_layers,
                _kib(layer.residual_bytes),
                _kib(kv_per_layer),
                _kib(fp.residual_bytes_per_token()),
                _kib(fp.kv_bytes_per_token()),
                round(entry["headline_ratio"], 1),
                round(entry["like_for_like_ratio"], 2),
                "residual" if entry["like_for_like_ratio"] < 1 else "K/V",
            ]
        )
    section.data = data
    section.tables.append(
        Table(
            [
                "model (bf16)",
                "layers",
                "residual / layer KiB",
                "K+V / layer KiB",
                "residual all layers KiB",
                "K+V all layers KiB",
                "headline: all K/V / one residual",
                "like for like: residual / K+V",
                "smaller exact form",
            ],
            rows,
        )
    )
    gemma = data.get("gemma-3-4b")
    mha = [a for a, e in data.items() if e["like_for_like_ratio"] < 1]
    gqa = [a for a, e in data.items() if e["like_for_like_ratio"] >= 1]
    if gemma:
        section.claims.append(
            Claim(
                "Gemma 3 4B: 5 KiB residual vs 136 KiB K/V per token (the paper's headline)",
                abs(gemma["residual_per_layer"] - 5 * 1024) < 64
                and abs(gemma["kv_all_layers"] - 136 * 1024) < 1024,
                f"{_kib(gemma['residual_per_layer'])} KiB (ONE layer) vs "
                f"{_kib(gemma['kv_all_layers'])} KiB (ALL 34 layers): true arithmetic, but not "
                "like for like; per layer it is "
                f"{_kib(gemma['residual_per_layer'])} vs {_kib(gemma['kv_per_layer'])} KiB",
            )
        )
    section.claims.append(
        Claim(
            "a residual checkpoint per layer is smaller than that layer's K+V",
            not gqa,
            f"smaller only for {', '.join(mha) or 'none'} (MHA); larger for "
            f"{', '.join(gqa) or 'none'} (GQA)",
        )
    )
    section.summary = (
        "Per token, bf16. The paper's headline compares one layer's residual with every "
        "layer's K/V. Holding one residual per token (or just the token id) and rebuilding "
        "every layer from it is a re-prefill, not a projection; exact per-layer recompute "
        "needs a residual per layer, which costs more than K/V for grouped-query models. "
        "kvchat's `--checkpoint auto` therefore keeps K/V on those layers."
    )
    return section
