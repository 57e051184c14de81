"""Markov property by residual patching: the residual stream at one layer is the whole state.

For an ordered pair of prompts (A, B) from different tasks, cut to the same length n, the
residual ``h_l`` entering decoder layer ``l`` is captured at every position of A's run. B is
then run with a forward pre-hook on layer ``l`` that replaces its input (every position) with
A's ``h_l``. If the stream at layer ``l`` is the whole state, the patched run's next-token
distribution (last position) is A's: D_KL(P_A || P_patched) = 0, and on the same machine the
logits are even ``torch.equal`` (layers ``l..L-1`` get the same inputs, the same positions
and the same causal mask). ``l = L`` patches the input of the final norm.

Two references make the result mean something:

* baseline -- B unpatched against A: how different the two prompts' predictions are;
* control -- at layer ``l`` only the LAST position is replaced by A's vector: one vector is
  not the state, the earlier positions' residuals (what K/V are computed from) carry the
  context, so KL > 0 for every ``l < L``. At ``l = L`` the last position's final-norm input
  alone decides the last logits, so the control is exact there too.

Runs use ``use_cache=False`` and ``logits_to_keep=1`` throughout, so every run has the
same shapes.
"""

from __future__ import annotations

import time
from itertools import permutations
from typing import Any

import torch

from kvchat.lab.context import LabContext
from kvchat.lab.report import Claim, Section, Table

FLOOR = 1e-12  # where KL = 0 is drawn on the log-scale plot


def _sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"real_tokens": 24, "tiny_tokens": 24, "real_pairs": 2}
    return {"real_tokens": 48, "tiny_tokens": 32, "real_pairs": None}


def patch_points(model: Any) -> list[Any]:
    """Decoder layers 0..L-1, then the final norm (the stream after the last layer)."""
    from kvchat.engine.kvdirect.arch import ArchAdapter

    adapter = ArchAdapter(model)
    backbone = adapter.backbone
    final = getattr(backbone, "norm", None) or getattr(backbone, "ln_f", None)
    return list(adapter.decoder_layers) + ([final] if final is not None else [])


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _capture(points: list[Any], store: list[torch.Tensor | None]):
    def make(i: int):
        def hook(module, args, kwargs):
            store[i] = _hidden(args, kwargs).clone()

        return hook

    return [p.register_forward_pre_hook(make(i), with_kwargs=True) for i, p in enumerate(points)]


def _replace(point: Any, replacement: torch.Tensor):
    def hook(module, args, kwargs):
        if args:
            return (replacement, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": replacement}

    return point.register_forward_pre_hook(hook, with_kwargs=True)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]


def _run(model: Any, ids: torch.Tensor, points: list[Any], hooks_at=None):
    """Logits of the last position; the stream at every patch point; optional patch."""
    store: list[torch.Tensor | None] = [None] * len(points)
    handles = _capture(points, store)
    if hooks_at is not None:
        handles.append(_replace(*hooks_at))
    try:
        logits = _logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    return logits, store


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """D_KL(P || Q) of the softmax distributions, in float64 (exactly 0 for equal logits;
    not clamped, so a rounding-level negative value shows as what it is)."""
    lp = torch.log_softmax(p_logits.double(), -1)
    lq = torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def patch_pair(model: Any, ids_a: list[int], ids_b: list[int]) -> dict[str, Any]:
    """Patch A's stream into B's run at every point: full stream and last position only."""
    device = next(model.parameters()).device
    a = torch.tensor([ids_a], device=device)
    b = torch.tensor([ids_b], device=device)
    points = patch_points(model)
    with torch.inference_mode():
        logits_a, h_a = _run(model, a, points)
        logits_b, h_b = _run(model, b, points)
        rows = []
        for i, point in enumerate(points):
            patched = h_a[i]
            p_logits = _logits_with(model, b, point, patched)
            control = h_b[i].clone()
            control[:, -1] = h_a[i][:, -1]
            c_logits = _logits_with(model, b, point, control)
            rows.append(
                {
                    "point": i,
                    "kl": kl(logits_a, p_logits),
                    "logits_equal": torch.equal(logits_a, p_logits),
                    "max_abs_logit_diff": float((logits_a.float() - p_logits.float()).abs().max()),
                    "argmax_equal": int(logits_a.argmax()) == int(p_logits.argmax()),
                    "control_kl": kl(logits_a, c_logits),
                    "control_argmax_equal": int(logits_a.argmax()) == int(c_logits.argmax()),
                }
            )
    return {
        "tokens": len(ids_a),
        "baseline_kl": kl(logits_a, logits_b),
        "baseline_argmax_equal": int(logits_a.argmax()) == int(logits_b.argmax()),
        "points": rows,
    }


def _logits_with(model: Any, ids: torch.Tensor, point: Any, replacement: torch.Tensor):
    handle = _replace(point, replacement)
    try:
        return _logits(model, ids)
    finally:
        handle.remove()


def run_model(model: Any, prompts: dict[str, list[int]], n: int, pairs=None) -> dict[str, Any]:
    """Every ordered pair of task prompts (or ``pairs``), each cut to ``n`` tokens."""
    names = list(prompts)
    chosen = list(permutations(names, 2)) if pairs is None else pairs
    layers = len(patch_points(model))
    results = []
    for name_a, name_b in chosen:
        r = patch_pair(model, prompts[name_a][:n], prompts[name_b][:n])
        r.update(a=name_a, b=name_b)
        results.append(r)
    return {"tokens": n, "points": layers, "pairs": results}


def _common_length(prompts: dict[str, list[int]], cap: int) -> int:
    n = min(min(len(ids) for ids in prompts.values()), cap)
    if n < 16:
        raise ValueError(f"task prompts are only {n} tokens long; 16 are needed")
    return n


def _summarize(result: dict[str, Any]) -> dict[str, Any]:
    pairs = result["pairs"]
    n_points = result["points"]
    per_point_zero = [all(p["points"][i]["kl"] == 0 for p in pairs) for i in range(n_points)]
    per_point_equal = [all(p["points"][i]["logits_equal"] for p in pairs) for i in range(n_points)]
    per_point_argmax = [all(p["points"][i]["argmax_equal"] for p in pairs) for i in range(n_points)]
    inner = range(n_points - 1)  # control is expected > 0 before the final norm
    return {
        "kl_zero": sum(per_point_zero),
        "logits_equal": sum(per_point_equal),
        "argmax_equal": sum(per_point_argmax),
        "max_kl": max(pt["kl"] for p in pairs for pt in p["points"]),
        "baseline_min": min(p["baseline_kl"] for p in pairs),
        "control_max": max(pt["control_kl"] for p in pairs for pt in p["points"]),
        "control_min_inner": min(
            (p["points"][i]["control_kl"] for p in pairs for i in inner), default=float("nan")
        ),
        "control_positive_inner": sum(
            all(p["points"][i]["control_kl"] > 0 for p in pairs) for i in inner
        ),
        "control_last_point_kl": max(p["points"][-1]["control_kl"] for p in pairs),
    }


def run(ctx: LabContext) -> Section:
    from kvchat.lab.prompts import task_ids
    from kvchat.lab.tiny_models import FAMILIES, tiny_model

    sizes = _sizes(ctx.quick)
    section = Section(
        key="markov",
        title="Markov property: the residual stream at one layer is the whole state",
    )
    runs = []
    real = ctx.models[:1] if ctx.quick else ctx.models
    for spec in real:
        t0 = time.perf_counter()
        loaded = ctx.load(spec, "float32")
        prompts = task_ids(loaded.tokenizer)
        n = _common_length(prompts, sizes["real_tokens"])
        pairs = None
        if sizes["real_pairs"] is not None:
            pairs = list(permutations(prompts, 2))[:: 6 // sizes["real_pairs"]]
        result = run_model(loaded.model, prompts, n, pairs)
        result.update(model=spec, kind="real", dtype="float32", seconds=time.perf_counter() - t0)
        runs.append(result)
        ctx.say(f"markov: {spec}: {len(result['pairs'])} pairs in {result['seconds']:.1f} s")
    for family in FAMILIES:
        t0 = time.perf_counter()
        model = tiny_model(family).to(ctx.device)
        prompts = task_ids(None)
        n = _common_length(prompts, sizes["tiny_tokens"])
        result = run_model(model, prompts, n)
        result.update(model=family, kind="tiny", dtype="float32", seconds=time.perf_counter() - t0)
        runs.append(result)

    rows = []
    for r in runs:
        s = _summarize(r)
        r["summary"] = s
        label = r["model"] if r["kind"] == "real" else f"{r['model']} (tiny)"
        n_points = r["points"]
        rows.append(
            [
                label,
                r["tokens"],
                len(r["pairs"]),
                f"{s['kl_zero']}/{n_points}",
                s["max_kl"],
                f"{s['logits_equal']}/{n_points}",
                f"{s['argmax_equal']}/{n_points}",
                s["baseline_min"],
                s["control_min_inner"],
                s["control_max"],
            ]
        )
    section.tables.append(
        Table(
            [
                "model",
                "tokens",
                "pairs",
                "points with KL = 0",
                "max KL (patched)",
                "logits equal",
                "argmax equal",
                "min KL unpatched (A vs B)",
                "min KL control (l < L)",
                "max KL control",
            ],
            rows,
            caption=(
                "Residual patching, fp32. Points are layers 0..L-1 (input of decoder layer l) "
                "and L (input of the final norm); a point counts when every ordered pair of "
                "task prompts (arithmetic, translation, story) passes. KL is "
                "D_KL(P_A || P_patched) at the last position. Control: only the last "
                "position's vector is patched."
            ),
        )
    )
    section.data = {"sizes": sizes, "runs": runs}

    all_zero = all(r["summary"]["kl_zero"] == r["points"] for r in runs)
    all_equal = all(r["summary"]["logits_equal"] == r["points"] for r in runs)
    total_points = sum(r["points"] for r in runs)
    zero_points = sum(r["summary"]["kl_zero"] for r in runs)
    worst = max(r["summary"]["max_kl"] for r in runs)
    section.claims.append(
        Claim(
            "the residual stream at one layer is the whole state (KL = 0 at every layer)",
            bool(runs) and all_zero,
            f"KL = 0 at {zero_points}/{total_points} patch points over {len(runs)} models "
            f"(every ordered prompt pair; max KL {worst:.3g}); logits torch.equal at every "
            f"point: {'yes' if all_equal else 'NO'}",
        )
    )
    control_ok = all(r["summary"]["control_positive_inner"] == r["points"] - 1 for r in runs)
    control_min = min(r["summary"]["control_min_inner"] for r in runs)
    baseline_min = min(r["summary"]["baseline_min"] for r in runs)
    section.claims.append(
        Claim(
            "one position's residual is not the state (last-position patch changes the "
            "output at every layer l < L)",
            bool(runs) and control_ok,
            f"control KL > 0 at every layer for every model and pair: "
            f"{'yes' if control_ok else 'NO'} (min {control_min:.3g}); unpatched A vs B "
            f"KL >= {baseline_min:.3g}",
        )
    )
    real_names = [r["model"] for r in runs if r["kind"] == "real"]
    section.summary = (
        f"Ordered pairs of task prompts cut to the same length; B's run gets A's residual "
        f"stream at one point. {len(runs)} models ({', '.join(real_names) or 'no real model'} "
        f"and the tiny families), {total_points} patch points: KL = 0 at {zero_points}, "
        f"logits bit-identical at {sum(r['summary']['logits_equal'] for r in runs)}. "
        f"Patching only the last position leaves KL >= {control_min:.3g} before the final norm "
        f"(the unpatched prompts differ by KL >= {baseline_min:.3g}); at the final norm the "
        "last position alone decides the last logits, so the control is exact there."
    )
    fig = _figure(ctx, [r for r in runs if r["kind"] == "real"])
    if fig:
        section.figures.append(fig)
    return section


def _figure(ctx: LabContext, runs: list[dict[str, Any]]) -> str | None:
    plt = ctx.pyplot("Markov")
    if plt is None:
        return None
    from matplotlib.ticker import MaxNLocator

    if not runs:
        return None
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, r in zip(axes[0], runs):
        xs = list(range(r["points"]))
        pairs = r["pairs"]
        full = [max(max(p["points"][i]["kl"] for p in pairs), FLOOR) for i in xs]
        ctrl = [[max(p["points"][i]["control_kl"], FLOOR) for p in pairs] for i in xs]
        ctrl_mean = [sum(c) / len(c) for c in ctrl]
        ax.fill_between(xs, [min(c) for c in ctrl], [max(c) for c in ctrl], color="C1", alpha=0.2)
        ax.plot(xs, ctrl_mean, color="C1", marker=".", label="control: last position only")
        ax.plot(xs, full, color="C0", marker="o", ms=4, label="full stream (max, all pairs)")
        base = [p["baseline_kl"] for p in pairs]
        ax.axhspan(min(base), max(base), color="grey", alpha=0.15)
        ax.axhline(
            sum(base) / len(base), color="grey", ls="--", label="unpatched B vs A (mean, range)"
        )
        ax.axhline(FLOOR, color="grey", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{r['model']}: D_KL(P_A || P_patched)")
        ax.set_xlabel(f"patch point l (0..{r['points'] - 2} layers, {r['points'] - 1} final norm)")
        ax.set_ylabel(f"KL (0 drawn at {FLOOR:g})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return ctx.save_figure(fig, "markov_kl_per_layer")
