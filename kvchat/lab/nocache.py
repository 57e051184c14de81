"""No cache at all: recompute everything from the token ids at every step.

The extreme form of "K/V are a function of what came before": drop every cache and run the
whole sequence through the model again for each new token (``use_cache=False``). Greedy
decoding that way is compared with the standard path (one prefill into ``DynamicCache``,
then one token per call). The logits need not be bit-identical -- the no-cache run puts
``n`` rows through every GEMM where the cached run puts one, and on CPU a row's result
depends on the row count -- so the experiment reports the per-step logit difference along
with the token match.

Both loops decode a fixed number of tokens, past an end-of-sequence token if the model
emits one, so every run compares the same number of steps.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from kvchat.lab.context import LabContext
from kvchat.lab.report import Claim, Section, Table
from kvchat.units import one_line

FLOOR = 1e-9  # where an exact zero is drawn on the log-scale plot


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"real_new": 8, "tiny_new": 16, "tiny_prompt": 24}
    return {"real_new": 48, "tiny_new": 48, "tiny_prompt": 32}


def cached_greedy(model: Any, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Reference: one prefill into ``DynamicCache``, then one token per forward call."""
    from transformers import DynamicCache

    from kvchat.engine.chat.generate import forward

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    tokens, seen = [], []
    logits = forward(model, cache, prompt, device)
    for step in range(new):
        seen.append(logits.float().clone())
        tokens.append(int(torch.argmax(logits)))
        if step < new - 1:
            logits = forward(model, cache, [tokens[-1]], device)
    return tokens, seen


def uncached_greedy(
    model: Any, prompt: list[int], new: int
) -> tuple[list[int], list[torch.Tensor]]:
    """The whole sequence from scratch at every step, no cache anywhere."""
    device = next(model.parameters()).device
    sequence = list(prompt)
    tokens, seen = [], []
    for _ in range(new):
        ids = torch.tensor([sequence], device=device)
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]
        seen.append(logits.float().clone())
        tokens.append(int(torch.argmax(logits)))
        sequence.append(tokens[-1])
    return tokens, seen


def compare(model: Any, prompt: list[int], new: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with torch.inference_mode():
        ref_tokens, ref_logits = cached_greedy(model, prompt, new)
        t1 = time.perf_counter()
        tokens, logits = uncached_greedy(model, prompt, new)
    t2 = time.perf_counter()
    matches = [a == b for a, b in zip(ref_tokens, tokens)]
    first = next((i for i, same in enumerate(matches) if not same), None)
    # Logits are comparable while both runs have seen the same tokens: up to and including
    # the first step whose choice differs.
    last_comparable = new - 1 if first is None else first
    diffs = [
        float((a - b).abs().max()) if i <= last_comparable else float("nan")
        for i, (a, b) in enumerate(zip(ref_logits, logits))
    ]
    equal = [
        torch.equal(a, b) if i <= last_comparable else None
        for i, (a, b) in enumerate(zip(ref_logits, logits))
    ]
    margins = []
    for lg in ref_logits:
        top = torch.topk(lg, 2).values
        margins.append(float(top[0] - top[1]))
    return {
        "prompt_tokens": len(prompt),
        "new_tokens": new,
        "reference_tokens": ref_tokens,
        "nocache_tokens": tokens,
        "token_match": sum(matches) / len(matches) if matches else float("nan"),
        "first_divergence": first,
        "max_abs_logit_diff_per_step": diffs,
        "logits_equal_per_step": equal,
        "top2_margin_per_step": margins,
        "cached_seconds": t1 - t0,
        "nocache_seconds": t2 - t1,
    }


def _prompt(loaded: Any) -> tuple[list[int], str]:
    from kvchat.lab.prompts import CHAT_QUESTION, COMPLETION, chat_ids, text_ids

    if loaded.has_chat_template:
        return chat_ids(loaded.tokenizer, CHAT_QUESTION), "chat: " + CHAT_QUESTION
    return text_ids(loaded.tokenizer, COMPLETION), "completion: " + COMPLETION


def run(ctx: LabContext) -> Section:
    from kvchat.lab.prompts import TASKS, byte_ids
    from kvchat.lab.tiny_models import FAMILIES, tiny_model

    sizes = _sizes(ctx.quick)
    section = Section(
        key="nocache",
        title="No cache at all: recomputing from scratch at every step",
    )
    runs = []
    real = ctx.models[:1] if ctx.quick else ctx.models
    for spec in real:
        loaded = ctx.load(spec, "float32")
        prompt, what = _prompt(loaded)
        result = compare(loaded.model, prompt, sizes["real_new"])
        result.update(model=spec, kind="real", dtype="float32", prompt=what)
        result["text"] = loaded.tokenizer.decode(result["reference_tokens"])
        runs.append(result)
        ctx.say(
            f"nocache: {spec}: token match {result['token_match']:.2f} "
            f"({result['cached_seconds'] + result['nocache_seconds']:.1f} s)"
        )
    tiny_prompt = byte_ids(TASKS["story"])[: sizes["tiny_prompt"]]
    for family in FAMILIES:
        model = tiny_model(family).to(ctx.device)
        result = compare(model, tiny_prompt, sizes["tiny_new"])
        result.update(model=family, kind="tiny", dtype="float32", prompt="story prompt bytes")
        runs.append(result)

    rows = []
    for r in runs:
        diffs = [d for d in r["max_abs_logit_diff_per_step"] if not math.isnan(d)]
        equal = [e for e in r["logits_equal_per_step"] if e is not None]
        r["max_abs_logit_diff"] = max(diffs) if diffs else float("nan")
        rows.append(
            [
                r["model"] if r["kind"] == "real" else f"{r['model']} (tiny)",
                r["prompt_tokens"],
                r["new_tokens"],
                f"{round(r['token_match'] * r['new_tokens'])}/{r['new_tokens']}",
                "none" if r["first_divergence"] is None else r["first_divergence"],
                r["max_abs_logit_diff"],
                f"{sum(equal)}/{len(equal)}",
                min(r["top2_margin_per_step"]),
            ]
        )
    section.tables.append(
        Table(
            [
                "model",
                "prompt tokens",
                "new tokens",
                "token match",
                "first divergence",
                "max abs logit diff",
                "steps with equal logits",
                "min top-2 margin",
            ],
            rows,
            caption=(
                "Greedy, fp32: DynamicCache (prefill, then one token per call) vs the whole "
                "sequence re-run with `use_cache=False` at every step. Logit differences are "
                "over the steps where both runs had seen the same tokens. The top-2 margin "
                "(reference logits) shows how close a step came to a tie."
            ),
        )
    )
    examples = [[r["model"], r["prompt"], r["text"]] for r in runs if r["kind"] == "real"]
    if examples:
        section.tables.append(
            Table(
                ["model", "prompt", "greedy output (reference)"],
                [[m, p, one_line(t, 160).replace("|", "/")] for m, p, t in examples],
            )
        )
    section.data = {"sizes": sizes, "runs": runs}

    identical = all(r["token_match"] == 1.0 for r in runs)
    worst = max((r["max_abs_logit_diff"] for r in runs), default=float("nan"))
    bad = [r["model"] for r in runs if r["token_match"] != 1.0]
    steps = sum(r["new_tokens"] for r in runs)
    section.claims.append(
        Claim(
            "no cache at all: recomputing everything from scratch at every step gives "
            "token-identical greedy output",
            bool(runs) and identical,
            f"{len(runs)} models, {steps} greedy steps: "
            + ("every token identical" if identical else f"diverged for {', '.join(bad)}")
            + f"; max abs logit diff {worst:.3g} (not bit-identical: different GEMM shapes)",
        )
    )
    section.summary = (
        f"Greedy decoding of {sizes['real_new']} tokens (real models) and {sizes['tiny_new']} "
        f"(tiny families) with a standard cache, and again with no cache at all. Tokens: "
        + ("identical in every run" if identical else f"differ for {', '.join(bad)}")
        + f". Logits differ by up to {worst:.3g}: the arithmetic is the same function of the "
        "tokens, evaluated with other GEMM shapes, so it agrees to rounding, not bit for bit."
    )
    fig = _figure(ctx, [r for r in runs if r["kind"] == "real"])
    if fig:
        section.figures.append(fig)
    return section


def _figure(ctx: LabContext, runs: list[dict[str, Any]]) -> str | None:
    plt = ctx.pyplot("no-cache")
    if plt is None:
        return None

    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for n, r in enumerate(runs):
        steps = range(len(r["max_abs_logit_diff_per_step"]))
        ys = [max(d, FLOOR) for d in r["max_abs_logit_diff_per_step"]]
        ax.plot(steps, ys, marker="o", ms=3, color=f"C{n}", label=f"{r['model']} logit diff")
        if r["first_divergence"] is not None:
            ax.axvline(r["first_divergence"], color=f"C{n}", ls=":", label="first divergence")
    ax.axhline(FLOOR, color="grey", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("decode step")
    ax.set_ylabel(f"max |logit diff| (0 drawn at {FLOOR:g})")
    ax.set_title("cached vs no-cache greedy decoding, fp32")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return ctx.save_figure(fig, "nocache_logit_diff")
