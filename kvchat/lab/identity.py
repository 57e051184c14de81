"""Identity: K/V recomputed from residual checkpoints against the standard cache, per layer.

One prompt is prefilled in chunks, then a few tokens are decoded, through transformers'
``DynamicCache`` (the reference) and through ``KVDirectCache`` with a small hot window (the
decoded tokens are forced to the reference's, so both caches see the same inputs). Then, per
layer, the K/V of every cold position (a position whose K/V the KV-Direct cache no longer
holds) are rebuilt from the checkpoints two ways and compared with ``DynamicCache``'s:

* replayed -- what the engine does (``KVDirectLayer.cold_kv``): each original forward
  call's rows go through the projection in the same shape as when they were first computed;
* naive batched -- every cold row in one projection call, the obvious implementation. On
  CPU the GEMM's per-row result depends on the row count, so this one is not expected to be
  bit-identical; it is reported as a contrast.

It also records what each ``cache.update`` handed to attention at every step of the run and
checks it against the reference, so the comparison covers the K/V attention actually used.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvchat.lab.context import LabContext
from kvchat.lab.report import Claim, Section, Table

DTYPES = ("float32", "bfloat16")
HOT_WINDOW = 4
FLOOR = 1e-10  # where an exact zero is drawn on the log-scale plot


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"tiny_prompt": 40, "real_prompt": 48, "chunk": 16, "decode": 8}
    return {"tiny_prompt": 64, "real_prompt": 160, "chunk": 32, "decode": 32}


def _record_updates(cache: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Wrap ``cache.update`` so the (K, V) it hands to attention in a call is kept, per layer."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    original = cache.update

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        k, v = original(key_states, value_states, layer_idx, *args, **kwargs)
        seen[layer_idx] = (k.clone(), v.clone())  # the cache reuses its buffers
        return k, v

    cache.update = update
    return seen


def _calls(ids: list[int], chunk: int, decode: int) -> list[list[int] | None]:
    """The forward calls of a run: prefill chunks, then ``decode`` one-token calls (None:
    the token is the reference's greedy choice, known only when the call comes)."""
    return [ids[i : i + chunk] for i in range(0, len(ids), chunk)] + [None] * decode


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.float() - b.float()).abs().max())


def _naive(layer: Any, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All cold rows of ``[begin, end)`` through norm, ONE projection call, k-norm, RoPE."""
    adapter = layer.owner.adapter
    idx = layer.layer_idx
    calls = layer.store.pieces_in(begin, end)
    # Rows the cache moved to disk (a disk tier) are read back the way the cache reads them.
    hidden = torch.cat(layer.store.load(calls, "cpu"), dim=1)
    first = calls[0].start
    hidden = hidden[:, begin - first : end - first]
    key, value = adapter.project(idx, adapter.normalize(idx, hidden))
    positions = torch.arange(begin, end, device=hidden.device).unsqueeze(0)
    return adapter.finish(idx, key, value, hidden, positions)


def compare(model: Any, ids: list[int], chunk: int, decode: int) -> dict[str, Any]:
    """Run ``ids`` through both caches in lockstep; per-layer comparison of the K/V."""
    from transformers import DynamicCache

    from kvchat.engine.chat.generate import forward
    from kvchat.engine.kvdirect.arch import ArchAdapter
    from kvchat.engine.kvdirect.cache import KVDirectCache

    device = next(model.parameters()).device
    standard = DynamicCache(config=model.config)
    adapter = ArchAdapter(model)
    ours = KVDirectCache(adapter, ["residual"] * adapter.num_layers, HOT_WINDOW)
    ref_seen, our_seen = _record_updates(standard), _record_updates(ours)
    n_layers = adapter.num_layers
    steps_equal = [True] * n_layers
    steps_max = [0.0] * n_layers
    steps = [0] * n_layers
    logits = None
    with torch.inference_mode():
        # Call by call: the reference first, then KV-Direct with the same tokens, then
        # compare what attention got at every layer (the decoded token is the reference's).
        for call in _calls(ids, chunk, decode):
            call = call if call is not None else [int(torch.argmax(logits))]
            ref_seen.clear()
            our_seen.clear()
            logits = forward(model, standard, call, device)
            with ours:
                forward(model, ours, call, device)
            for idx in range(n_layers):
                if idx not in ref_seen or idx not in our_seen:
                    steps_equal[idx] = False
                    continue
                (rk, rv), (ok, ov) = ref_seen[idx], our_seen[idx]
                steps[idx] += 1
                if rk.shape != ok.shape:
                    steps_equal[idx] = False
                    continue
                steps_equal[idx] &= torch.equal(rk, ok) and torch.equal(rv, ov)
                steps_max[idx] = max(steps_max[idx], _max_abs(rk, ok), _max_abs(rv, ov))
        ref_seen.clear()
        our_seen.clear()
        recomputed_during_run = ours.stats.recomputed_tokens

        layers = []
        for idx, (mine, ref) in enumerate(zip(ours.layers, standard.layers)):
            n = mine.cumulative_length
            hot_from = n - mine.hot_length
            # DynamicCache keeps everything (full layer) or the last window - 1 (sliding).
            begin = n - ref.keys.shape[-2]
            cold = hot_from - begin
            row: dict[str, Any] = {
                "layer": idx,
                "sliding": mine.is_sliding,
                "tokens": n,
                "cold_tokens": cold,
            }
            ref_k, ref_v = ref.keys[..., :cold, :], ref.values[..., :cold, :]
            if cold > 0:
                k, v = mine.cold_kv(begin, hot_from)
                row["replay_equal"] = torch.equal(k, ref_k) and torch.equal(v, ref_v)
                row["replay_max_abs"] = max(_max_abs(k, ref_k), _max_abs(v, ref_v))
                nk, nv = _naive(mine, begin, hot_from)
                row["naive_equal"] = torch.equal(nk, ref_k) and torch.equal(nv, ref_v)
                row["naive_max_abs"] = max(_max_abs(nk, ref_k), _max_abs(nv, ref_v))
            else:
                row.update(replay_equal=None, replay_max_abs=None)
                row.update(naive_equal=None, naive_max_abs=None)
            row["hot_equal"] = torch.equal(mine.keys, ref.keys[..., cold:, :]) and torch.equal(
                mine.values, ref.values[..., cold:, :]
            )
            row["steps"] = steps[idx]
            row["steps_equal"] = steps_equal[idx] and steps[idx] > 0
            row["steps_max_abs"] = steps_max[idx]
            layers.append(row)
    return {
        "prompt_tokens": len(ids),
        "decoded_tokens": decode,
        "chunk": chunk,
        "hot_window": HOT_WINDOW,
        "recomputed_tokens_during_run": recomputed_during_run,
        "layers": layers,
    }


def _cases(ctx: LabContext) -> list[tuple[str, str, str]]:
    """(kind, name, dtype): every tiny family and the real models, fp32 and bf16."""
    from kvchat.lab.tiny_models import FAMILIES

    real = ctx.models[:1] if ctx.quick else ctx.models
    cases = [("tiny", f, d) for f in FAMILIES for d in DTYPES]
    return cases + [("real", m, d) for m in real for d in DTYPES]


def _summarize(result: dict[str, Any]) -> dict[str, Any]:
    checked = [r for r in result["layers"] if r["cold_tokens"] > 0]
    replay_ok = [r for r in checked if r["replay_equal"]]
    naive_ok = [r for r in checked if r["naive_equal"]]
    return {
        "layers": len(result["layers"]),
        "checked": len(checked),
        "replay_equal": len(replay_ok),
        "replay_max": max((r["replay_max_abs"] for r in checked), default=float("nan")),
        "naive_equal": len(naive_ok),
        "naive_max": max((r["naive_max_abs"] for r in checked), default=float("nan")),
        "steps_equal": sum(1 for r in result["layers"] if r["steps_equal"]),
        "hot_equal": sum(1 for r in result["layers"] if r["hot_equal"]),
        "cold_max": max((r["cold_tokens"] for r in result["layers"]), default=0),
    }


def run(ctx: LabContext) -> Section:
    from kvchat.lab.prompts import passage_ids
    from kvchat.lab.tiny_models import tiny_model

    sizes = _sizes(ctx.quick)
    section = Section(
        key="identity",
        title="Identity: recomputed K/V against the standard cache, per layer",
    )
    rows, results = [], []
    for kind, name, dtype in _cases(ctx):
        t0 = time.perf_counter()
        if kind == "tiny":
            model = tiny_model(name, getattr(torch, dtype)).to(ctx.device)
            ids = passage_ids(None, sizes["tiny_prompt"])
            label = f"{name} (tiny)"
        else:
            loaded = ctx.load(name, dtype)
            model = loaded.model
            ids = passage_ids(loaded.tokenizer, sizes["real_prompt"])
            label = name
        result = compare(model, ids, sizes["chunk"], sizes["decode"])
        result.update(model=name, kind=kind, dtype=dtype, seconds=time.perf_counter() - t0)
        s = _summarize(result)
        result["summary"] = s
        results.append(result)
        ctx.say(
            f"identity: {label} {dtype}: {s['replay_equal']}/{s['checked']} layers equal, "
            f"naive {s['naive_equal']}/{s['checked']} ({result['seconds']:.1f} s)"
        )
        rows.append(
            [
                label,
                dtype,
                f"{s['replay_equal']}/{s['checked']}",
                s["replay_max"],
                f"{s['steps_equal']}/{s['layers']}",
                s["naive_max"],
                f"{s['naive_equal']}/{s['checked']}",
                s["cold_max"],
            ]
        )
    section.tables.append(
        Table(
            [
                "family / model",
                "dtype",
                "layers equal",
                "max abs diff (replayed)",
                "attention K/V equal every step",
                "max abs diff (naive batched)",
                "naive layers equal",
                "cold tokens",
            ],
            rows,
            caption=(
                "Per layer, K/V of the cold positions rebuilt from residual checkpoints vs "
                "DynamicCache (`torch.equal`). 'Replayed' is the engine's recompute (each "
                "original call's rows in their original GEMM shape); 'naive batched' puts "
                "every cold row through one projection call. 'Attention K/V equal every "
                "step' compares what each `cache.update` returned during the run. "
                f"Hot window {HOT_WINDOW} tokens."
            ),
        )
    )
    section.data = {"hot_window": HOT_WINDOW, "sizes": sizes, "runs": results}

    all_checked = sum(r["summary"]["checked"] for r in results)
    all_equal = sum(r["summary"]["replay_equal"] for r in results)
    steps_ok = all(r["summary"]["steps_equal"] == r["summary"]["layers"] for r in results)
    hot_ok = all(r["summary"]["hot_equal"] == r["summary"]["layers"] for r in results)
    naive_equal = sum(r["summary"]["naive_equal"] for r in results)
    held = all_checked > 0 and all_equal == all_checked and steps_ok and hot_ok
    worst = max((r["summary"]["replay_max"] for r in results), default=float("nan"))
    section.claims.append(
        Claim(
            "recomputed K/V are bit-identical to the standard cache "
            "(per layer, every family, fp32 and bf16)",
            held,
            f"{all_equal}/{all_checked} layer runs torch.equal over {len(results)} "
            f"model x dtype runs (max abs diff {worst:.3g}); attention K/V equal at every "
            f"step: {'yes' if steps_ok else 'NO'}; naive batched recompute equal at "
            f"{naive_equal}/{all_checked}",
        )
    )
    naive_bad = [
        f"{r['model']} {r['dtype']}"
        for r in results
        if r["summary"]["naive_equal"] < r["summary"]["checked"]
    ]
    section.summary = (
        f"{len(results)} runs (tiny families and {', '.join(_real(results)) or 'no real model'}"
        f"; prompt prefilled in chunks of {sizes['chunk']}, then {sizes['decode']} decoded "
        f"tokens, hot window {HOT_WINDOW}). Replayed recompute: {all_equal}/{all_checked} "
        f"layers bit-identical. Naive batched recompute: {naive_equal}/{all_checked} layers "
        "bit-identical"
        + (f"; not exact for {', '.join(naive_bad)}." if naive_bad else ".")
        + " Exactness depends on replaying the original GEMM shapes (docs/facts.md, section 3)."
    )
    fig = _figure(ctx, results)
    if fig:
        section.figures.append(fig)
    return section


def _real(results: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for r in results:
        if r["kind"] == "real" and r["model"] not in names:
            names.append(r["model"])
    return names


def _figure(ctx: LabContext, results: list[dict[str, Any]]) -> str | None:
    plt = ctx.pyplot("identity")
    if plt is None:
        return None

    names = _real(results)
    if not names:
        return None
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    styles = {
        ("float32", "replay"): ("C0", "o", "-"),
        ("float32", "naive"): ("C0", "x", ":"),
        ("bfloat16", "replay"): ("C1", "s", "-"),
        ("bfloat16", "naive"): ("C1", "+", ":"),
    }
    for ax, name in zip(axes[0], names):
        for r in results:
            if r["kind"] != "real" or r["model"] != name:
                continue
            layers = [row for row in r["layers"] if row["cold_tokens"] > 0]
            xs = [row["layer"] for row in layers]
            for how in ("replay", "naive"):
                ys = [max(row[f"{how}_max_abs"], FLOOR) for row in layers]
                color, marker, line = styles[(r["dtype"], how)]
                label = f"{r['dtype']} {'replayed' if how == 'replay' else 'naive batched'}"
                big = r["dtype"] == "float32" and how == "replay"  # else hidden under bf16
                ax.plot(
                    xs,
                    ys,
                    color=color,
                    marker=marker,
                    linestyle=line,
                    label=label,
                    ms=8 if big else 4,
                    mfc="none" if big else color,
                )
        ax.axhline(FLOOR, color="grey", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_title(f"{name}: recomputed vs cached K/V")
        ax.set_xlabel("layer")
        ax.set_ylabel(f"max |diff| (0 drawn at {FLOOR:g})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return ctx.save_figure(fig, "identity_per_layer")
