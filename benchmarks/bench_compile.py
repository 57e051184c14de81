"""Does torch.compile speed up kvchat's decode? The half of each layer's decode step that
computes no K/V (o_proj, the residual add, the post-attention norm and the gated MLP:
``DecodeStep.after_attention``), compiled with inductor, against the same half in eager
mode, on the default model (int4 weights).

Why only that half: the KV-Direct cache replays K/V from a layer's input with the eager
norm and projections, so compiled code that produced K/V (the input norm, q/k/v, the
rotary products) would give replays other bits than the steps' own. The half after
attention only writes the next layer's input, which every cache records alike; the
benchmark checks that bounded still gives unbounded's tokens with it.

Three measurements, each against eager in the same process:
1. the half alone, over the model's real layers (median microseconds per layer call, the
   two interleaved call by call in rounds);
2. whole replies (the same ~500-token prompt and 64 greedy tokens as ``bench_peers.py``),
   interleaved: decode tok/s and whether the greedy tokens match eager's;
3. what it costs: the first compile's seconds and the RSS it adds.

Needs a C++ compiler (inductor's CPU code is C++); without one it says so and stops.
Run from the repository root: ``python benchmarks/bench_compile.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch is imported)

from kvchat.lab import harness  # noqa: E402

EAGER = "decode step (eager, kvchat's default)"
COMPILED = "decode step, after-attention half compiled"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the half alone")
    parser.add_argument("--out", default="results/bench_compile.json")
    args = parser.parse_args()
    wall = harness.stopwatch()
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        sys.exit("bench_compile: no C++ compiler on PATH (inductor needs one); nothing measured")

    import psutil
    import torch
    import torch._inductor.config as inductor_config
    from transformers import AutoTokenizer

    from kvchat.engine.chat.settings import CacheSettings
    from kvchat.engine.models.decode_step import decode_step_for
    from kvchat.engine.models.fused import ProjectionGroup
    from kvchat.engine.models.load import load
    from kvchat.engine.models.qlinear import Int4Linear, int4_mm
    from kvchat.engine.models.resolve import resolve_model
    from kvchat.lab.texts import STORY

    inductor_config.compile_threads = 1  # no pool of compile workers beside the engine
    path = str(resolve_model(args.model).path)
    loaded = load(path, device="cpu", dtype="float32", weights="auto")
    ids = AutoTokenizer.from_pretrained(path)(STORY, add_special_tokens=False)["input_ids"]
    ids = ids[: args.context]
    step = decode_step_for(loaded.model)
    if step is not None:
        step.use_native = False  # eager and compiled Python halves, not the C++ layers
    layers = step.layers if step is not None else []
    if not layers or not all(
        isinstance(layer.o_proj, Int4Linear)
        and isinstance(layer.down, Int4Linear)
        and layer.o_proj.form == "torch"
        and isinstance(layer.gate_up, ProjectionGroup)
        and layer.gate_up.int4
        and not layer.gate_up.has_bias
        and layer.o_proj.bias is None
        and layer.down.bias is None
        for layer in layers
    ):
        sys.exit(
            f"bench_compile: {args.model} has no int4 Llama-family decode step on torch's int4"
            " kernel (it compiles that one: run it with KVCHAT_INT4_KERNEL=0)"
        )

    def half(
        hidden: torch.Tensor,
        attention_out: torch.Tensor,
        o_weight: torch.Tensor,
        o_scales: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gate_up_weight: torch.Tensor,
        gate_up_scales: torch.Tensor,
        down_weight: torch.Tensor,
        down_scales: torch.Tensor,
        inner: int,
    ) -> torch.Tensor:
        # after_attention's ops on tensors only: one graph serves every layer (a module
        # argument would make dynamo specialise, and recompile, per layer).
        hidden = hidden + int4_mm(attention_out.reshape(1, -1), o_weight, o_scales).reshape(
            hidden.shape
        )
        variance = hidden.pow(2).mean(-1, keepdim=True)
        x = norm_weight * (hidden * torch.rsqrt(variance + eps))
        gate_up = int4_mm(x.reshape(1, -1), gate_up_weight, gate_up_scales)
        act = torch.nn.functional.silu(gate_up[:, :inner]) * gate_up[:, inner:]
        return hidden + int4_mm(act, down_weight, down_scales).reshape(hidden.shape)

    operands = [
        (
            layer.o_proj.packed,
            layer.o_proj.scales_and_zeros,
            layer.post_norm.weight,
            float(layer.post_norm.variance_epsilon),
            layer.gate_up.packed,
            layer.gate_up.scales_from_0,
            layer.down.packed,
            layer.down.scales_and_zeros,
            layer.gate_up.widths[0],
        )
        for layer in layers
    ]
    compiled_half = torch.compile(half, dynamic=False, fullgraph=True)
    width = step.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 1, width, generator=gen)
    attention_out = torch.randn(1, 1, width, generator=gen)

    # Grad mode as kvchat's generate runs (its tensors need no grad): dynamo guards on it.
    # A fresh inductor cache, so the first compile is what a user's first start pays.
    cache_dir = tempfile.TemporaryDirectory()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir.name
    with torch.no_grad():
        same_math = all(
            torch.equal(
                half(hidden, attention_out, *ops),
                step.after_attention(layer, hidden, attention_out),
            )
            for layer, ops in zip(layers, operands)
        )
        rss_before = psutil.Process().memory_info().rss
        started = time.perf_counter()
        compiled_half(hidden, attention_out, *operands[0])
        compile_seconds = time.perf_counter() - started
        rss_added = psutil.Process().memory_info().rss - rss_before
    harness.say(
        f"first compile {compile_seconds:.1f} s, RSS +{rss_added / 2**20:.1f} MiB; "
        f"eager re-spelling equals after_attention: {same_math}"
    )

    # 1. the half alone, eager and compiled call by call
    def per_call_us(fn: Any, calls: int = 20) -> float:
        started = time.perf_counter()
        for i in range(calls):
            fn(hidden, attention_out, *operands[i % len(operands)])
        return (time.perf_counter() - started) / calls * 1e6

    alone: dict[str, list[float]] = {"eager": [], "compiled": []}
    with torch.no_grad():
        for _ in range(args.rounds):
            for _ in range(10):
                alone["eager"].append(per_call_us(half))
                alone["compiled"].append(per_call_us(compiled_half))
    eager_us = harness.median(alone["eager"])
    compiled_us = harness.median(alone["compiled"])

    # 2. whole replies
    def compiled_after_attention(layer: Any, residual: torch.Tensor, out: torch.Tensor) -> Any:
        return compiled_half(residual, out, *operands[layer.index])

    def use(row: str) -> None:
        if row == COMPILED:
            step.after_attention = compiled_after_attention
        else:
            step.__dict__.pop("after_attention", None)

    def measure(row: str, rep: int) -> dict[str, Any]:
        use(row)
        result = common.decode_rate(loaded, ids, args.new_tokens)
        harness.say(f"[{rep + 1}/{args.repeats}] {row}: decode {result['decode_tok_s']:.1f} tok/s")
        return result

    use(COMPILED)
    started = time.perf_counter()
    # any recompile for the real tensors' layouts happens here, not in a timed row
    common.session_reply(loaded, ids, args.new_tokens)
    harness.say(f"warm-up reply with the compiled half: {time.perf_counter() - started:.1f} s")
    runs = harness.interleaved((EAGER, COMPILED), args.repeats, measure)
    same_tokens = all(a["tokens"] == b["tokens"] for a, b in zip(runs[EAGER], runs[COMPILED]))

    # the cache's contract with the compiled half: residual checkpoints on disk, replayed
    # every step, against the standard cache
    use(COMPILED)
    with tempfile.TemporaryDirectory() as spill:
        ceiling = CacheSettings(max_mem=4 * 10**6, checkpoint="residual")
        bounded = common.session_reply(
            loaded, ids, args.new_tokens, cache=ceiling, spill_root=Path(spill)
        )
    unbounded = common.session_reply(
        loaded, ids, args.new_tokens, cache=CacheSettings(kind="standard")
    )
    use(EAGER)
    bounded_same = bounded.tokens == unbounded.tokens

    eager_tps = harness.median(r["decode_tok_s"] for r in runs[EAGER])
    rows = [
        [EAGER, harness.fmt(eager_tps, 1), "1.00", "-"],
        [
            COMPILED,
            harness.fmt(harness.median(r["decode_tok_s"] for r in runs[COMPILED]), 1),
            harness.fmt(harness.median_ratio(runs[EAGER], runs[COMPILED], "seconds_per_token")),
            "yes" if same_tokens else "no",
        ],
    ]  # fmt: skip
    print(
        f"## bench_compile: {args.model} ({loaded.weights_mode} weights), {len(ids)}-token "
        f"prompt, {args.new_tokens} greedy tokens, median of {args.repeats} interleaved repeats\n"
    )
    print(f"after-attention half alone, median of {len(alone['eager'])} x 20 calls over "
          f"{len(layers)} layers: eager {eager_us:.1f} us, compiled {compiled_us:.1f} us "
          f"({eager_us / compiled_us:.2f}x)\n")  # fmt: skip
    print(harness.markdown_table(["decode", "decode tok/s", "vs eager", "eager's tokens"], rows))
    print(
        f"\nfirst compile: {compile_seconds:.1f} s, RSS +{rss_added / 2**20:.1f} MiB; "
        f"bounded (4 MB, residual checkpoints on disk) gives unbounded's tokens with the "
        f"compiled half: {'yes' if bounded_same else 'NO'}"
    )
    fields = {
        "rows": runs,
        "alone_us": alone,
        "alone_median_us": {"eager": eager_us, "compiled": compiled_us},
        "compile_seconds": compile_seconds,
        "compile_rss_added_bytes": rss_added,
        "same_tokens_as_eager": same_tokens,
        "bounded_equals_unbounded_compiled": bounded_same,
        "eager_respelling_equal": same_math,
    }
    harness.save_run(args.out, "bench_compile", fields, harness.environment(None), wall())
    cache_dir.cleanup()


if __name__ == "__main__":
    main()
