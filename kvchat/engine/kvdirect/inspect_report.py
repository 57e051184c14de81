"""``kvchat inspect MODEL``: the bytes-per-token table of docs/facts.md for one model.

``render_inspect`` gives plain text that fits 80 columns (runs of identical consecutive layers
share a row); ``inspect_as_dict`` gives the same figures, one entry per layer, for ``--json``.
Nothing here imports torch or transformers.
"""

from __future__ import annotations

import textwrap
from typing import Any

from kvchat.engine.kvdirect.footprint import LayerFootprint, ModelFootprint
from kvchat.units import precise_bytes as human_bytes


def _exact(n: float) -> str:
    """Exact byte count with thousands separators (one decimal when not whole)."""
    return f"{n:,.0f} B" if float(n).is_integer() else f"{n:,.1f} B"


def _layer_key(layer: LayerFootprint) -> tuple:
    return (
        layer.kind,
        layer.sliding_window,
        layer.kv_heads,
        layer.head_dim,
        layer.hidden_size,
        layer.kv_bytes,
        layer.residual_bytes,
    )


def layer_groups(fp: ModelFootprint) -> list[tuple[int, int, LayerFootprint]]:
    """Runs of consecutive identical layers as ``(first_index, last_index, layer)``."""
    groups: list[tuple[int, int, LayerFootprint]] = []
    for layer in fp.layers:
        if groups and _layer_key(groups[-1][2]) == _layer_key(layer):
            first, _, rep = groups[-1]
            groups[-1] = (first, layer.index, rep)
        else:
            groups.append((layer.index, layer.index, layer))
    return groups


def _kind_label(layer: LayerFootprint) -> str:
    if layer.sliding_window is None:
        return "full"
    short = layer.kind.removesuffix("_attention")
    return f"{short} {layer.sliding_window}"


def _ratio_summary(fp: ModelFootprint) -> tuple[float, float]:
    ratios = [layer.residual_to_kv for layer in fp.layers]
    return min(ratios), max(ratios)


def inspect_as_dict(fp: ModelFootprint, n_tokens: int = 4096) -> dict[str, Any]:
    """All figures of the report, one row per layer, JSON-serialisable."""
    kv_all = fp.kv_bytes_per_token()
    res_all = fp.residual_bytes_per_token()
    std = fp.standard_cache_bytes(n_tokens)
    lo, hi = _ratio_summary(fp)
    one_residual = max(layer.residual_bytes for layer in fp.layers)
    return {
        "model_type": fp.model_type,
        "name": fp.name,
        "dtype": fp.dtype,
        "itemsize": fp.itemsize,
        "num_layers": fp.num_layers,
        "num_sliding_layers": len(fp.sliding_layers),
        "layers": [
            {
                "index": layer.index,
                "kind": layer.kind,
                "sliding_window": layer.sliding_window,
                "kv_heads": layer.kv_heads,
                "head_dim": layer.head_dim,
                "hidden_size": layer.hidden_size,
                "kv_bytes_per_token": layer.kv_bytes,
                "residual_bytes_per_token": layer.residual_bytes,
                "residual_to_kv": layer.residual_to_kv,
                "smaller_exact_form": layer.smaller_exact_form,
                "standard_cache_tokens": layer.standard_cache_tokens(n_tokens),
            }
            for layer in fp.layers
        ],
        "per_token": {
            "kv_all_layers": kv_all,
            "residual_all_layers": res_all,
            "auto_all_layers": fp.cold_bytes_per_token("auto"),
            "kv_past_window": fp.kv_bytes_per_token_past_window(),
            "layers_by_smaller_form": fp.counts_by_form(),
        },
        "standard_cache": {
            "n_tokens": n_tokens,
            "bytes": std,
            "bytes_per_token": std / n_tokens if n_tokens else 0.0,
            "resident_bytes_decoding": fp.standard_cache_resident_bytes(n_tokens, 1),
            "bytes_without_window_cap": fp.full_cache_bytes(n_tokens),
        },
        "ratios": {
            "residual_to_kv_per_layer_min": lo,
            "residual_to_kv_per_layer_max": hi,
            "residual_to_kv_all_layers": fp.residual_to_kv_ratio(),
            "headline_misleading": {
                "description": (
                    "all layers' K+V per token / ONE layer's residual per token "
                    "(the paper's comparison; not like for like)"
                ),
                "one_layer_residual_bytes": one_residual,
                "all_layers_kv_bytes": kv_all,
                "ratio": fp.headline_ratio(),
            },
        },
    }


def _row(label: str, exact: float, human: str, note: str = "") -> str:
    return f"  {label:<26}{_exact(exact):>15}  {human:<10} {note}".rstrip()


def render_inspect(fp: ModelFootprint, n_tokens: int = 4096) -> str:
    """Plain-text bytes-per-token table for ``fp`` plus totals and ratios (80 columns)."""
    d = inspect_as_dict(fp, n_tokens)
    n_sliding = d["num_sliding_layers"]
    n_full = fp.num_layers - n_sliding
    title = fp.name or fp.model_type
    kind_note = f"{n_sliding} sliding, {n_full} full" if n_sliding else "all full attention"
    lines = [
        f"{title} ({fp.model_type})",
        f"{fp.num_layers} layers ({kind_note}), {fp.dtype} ({fp.itemsize} B per value)",
        "",
        f"{'layers':<8}{'attention':<15}{'kv x dim':>10}{'K+V B/tok':>11}"
        f"{'resid B/tok':>13}{'resid/KV':>10}  smaller",
    ]
    for first, last, layer in layer_groups(fp):
        span = str(first) if first == last else f"{first}-{last}"
        shape = f"{layer.kv_heads} x {layer.head_dim}"
        lines.append(
            f"{span:<8}{_kind_label(layer):<15}{shape:>10}{layer.kv_bytes:>11,}"
            f"{layer.residual_bytes:>13,}{layer.residual_to_kv:>10.3g}  {layer.smaller_exact_form}"
        )

    per = d["per_token"]
    by_form = per["layers_by_smaller_form"]
    kv_all, res_all, auto = per["kv_all_layers"], per["residual_all_layers"], per["auto_all_layers"]
    lines += [
        "",
        f"Per token, all {fp.num_layers} layers",
        _row("K+V", kv_all, human_bytes(kv_all)),
        _row(
            "residual checkpoints", res_all, human_bytes(res_all), f"{res_all / kv_all:.3g} x K+V"
        ),
        _row(
            "smaller form per layer",
            auto,
            human_bytes(auto),
            f"kv {by_form['kv']}, residual {by_form['residual']} layers",
        ),
    ]
    if n_sliding:
        past = per["kv_past_window"]
        note = f"{n_full} full layers grow" if n_full else "bounded: no full layers"
        lines.append(_row("K+V past the window", past, human_bytes(past), note))

    std = d["standard_cache"]
    lines += [
        "",
        f"Standard cache equivalent (DynamicCache) at {n_tokens:,} tokens",
        _row("total", std["bytes"], human_bytes(std["bytes"])),
        _row("per token", std["bytes_per_token"], human_bytes(std["bytes_per_token"])),
    ]
    if n_sliding:
        no_cap = std["bytes_without_window_cap"]
        lines.append(_row("without the window cap", no_cap, human_bytes(no_cap)))
        for window in sorted({layer.sliding_window for layer in fp.sliding_layers}):
            count = sum(1 for layer in fp.sliding_layers if layer.sliding_window == window)
            kept = min(n_tokens, max(window - 1, 0))
            lines.append(
                f"  {count} sliding layers (window {window}) keep the last {kept:,} tokens"
            )

    r = d["ratios"]
    lo, hi = r["residual_to_kv_per_layer_min"], r["residual_to_kv_per_layer_max"]
    per_layer = f"{lo:.3g} at every layer" if lo == hi else f"{lo:.3g} to {hi:.3g}"
    smaller_at = by_form["residual"]
    if smaller_at == fp.num_layers:
        verdict = "smaller than K+V at every layer"
    elif smaller_at == 0:
        verdict = "never smaller than K+V"
    else:
        verdict = f"smaller than K+V at {smaller_at} of {fp.num_layers} layers"
    head = r["headline_misleading"]
    headline = (
        f"Misleading comparison (the paper's headline): ONE layer's residual "
        f"({human_bytes(head['one_layer_residual_bytes'])}) vs ALL {fp.num_layers} layers' "
        f"K+V ({human_bytes(head['all_layers_kv_bytes'])}) per token, {head['ratio']:.3g}x. "
        "Not like for like: rebuilding every layer from one residual re-runs the "
        "stack (a re-prefill). Compare per layer, or all layers with all layers."
    )
    lines += [
        "",
        "Ratios",
        f"  residual / K+V, per layer     {per_layer}",
        f"  residual / K+V, all layers    {r['residual_to_kv_all_layers']:.3g}",
        f"  a residual checkpoint is {verdict}",
        "",
        *textwrap.wrap(headline, width=78),
    ]
    return "\n".join(lines) + "\n"
