"""What the lean decode step buys: kvchat's decode through the model's own forward, through
``kvchat.engine.models.decode_step`` in Python, and with its layers in C++
(``kvchat.engine.models.native``: what quantized models use once the library is built; the row is
skipped without a C++ compiler), in one process, interleaved. Every row calls the same
attention function (kvchat's exact kernel, once the model is routed to it).

Same model as the engine holds it (``--weights auto``: int4 for the default model), the
same ~500-token prompt of real text and 64 greedy tokens as ``bench_peers.py``, kvchat's
own ``generate`` loop and default cache in every row; only the one-token forward differs.
Decode tok/s = 63 / time from the first to the 64th token; ratios are paired per repeat
against the model-forward row, and every row must give its greedy tokens.

``--profile`` then runs the default row's steps under torch's profiler and prints where a
step's time goes, by kernel kind (per step, the profiler's own overhead included).

Run from the repository root: ``python benchmarks/bench_decode_step.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch is imported)

from kvchat.lab import harness  # noqa: E402

MODEL_PATH = "model forward (transformers' modules)"
EXACT = "decode step, Python layers"
NATIVE = "decode step, C++ layers (quantized default)"
ROWS = (MODEL_PATH, EXACT, NATIVE)
KINDS = {
    # The C++ halves' own time is mostly kvchat's int4 kernel and, in a decode step, its
    # attention kernel, which they call directly (their norms and other ATen ops are counted
    # as those ops). kvchat's kernels called from Python (attention where a streamed layer
    # is pending or the C++ layers are off; the int4 or int8 kernel of a quantized head) go
    # through ctypes, which the profiler does not see: they land in "between ops", and the
    # last row times the head apart.
    "kvchat_native": "C++ layers' own time (their int4 multiplies and attention)",
    "_weight_int4pack_mm": "int4 kernels (torch's)",
    "_weight_int8pack_mm": "int8 kernels (torch's: int8 layers, or the head without kvchat's)",
    "scaled_dot_product": "attention (torch's, where kvchat's kernel is off)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--profile", action="store_true", help="where a step's time goes")
    parser.add_argument("--out", default="results/bench_decode_step.json")
    args = parser.parse_args()
    wall = harness.stopwatch()

    import torch
    from transformers import AutoTokenizer

    import kvchat.engine.chat.generate as generate_module
    from kvchat.engine.models.decode_step import decode_step_for
    from kvchat.engine.models.load import load
    from kvchat.engine.models.resolve import resolve_model
    from kvchat.lab.texts import STORY

    path = str(resolve_model(args.model).path)
    loaded = load(path, device="cpu", dtype="auto", weights=args.weights, threads=args.threads)
    ids = AutoTokenizer.from_pretrained(path)(STORY, add_special_tokens=False)["input_ids"]
    ids = ids[: args.context]
    step = decode_step_for(loaded.model)
    if step is None:
        sys.exit(f"{args.model} has no lean decode step (not a Llama, Qwen2 or Gemma 3 model)")
    quantized = step.packs_gqa
    rows_run = ROWS if quantized and step.wait_for_native(600) else ROWS[:-1]
    if rows_run != ROWS:
        harness.say(f"skipped '{NATIVE}': no C++ layers (float weights or no C++ compiler)")
    with_step = generate_module.decode_step_for

    def use(row: str) -> None:
        generate_module.decode_step_for = (lambda _m: None) if row == MODEL_PATH else with_step
        step.use_native = row == NATIVE

    def measure(row: str, rep: int) -> dict[str, Any]:
        use(row)
        result = common.decode_rate(loaded, ids, args.new_tokens)
        harness.say(f"[{rep + 1}/{args.repeats}] {row}: decode {result['decode_tok_s']:.1f} tok/s")
        return result

    harness.say(f"load average at start: {harness.environment(None)['loadavg_at_start']}")
    runs = harness.interleaved(rows_run, args.repeats, measure)
    base = runs[MODEL_PATH]
    rows = []
    for row in rows_run:
        same = all(r["tokens"] == b["tokens"] for r, b in zip(runs[row], base))
        ratio = harness.median_ratio(base, runs[row], "seconds_per_token")
        tps = harness.median(r["decode_tok_s"] for r in runs[row])
        rows.append([row, harness.fmt(tps, 1), harness.fmt(ratio), "yes" if same else "NO"])
    weights = loaded.weights_mode
    print(
        f"## bench_decode_step: {args.model} ({weights} weights), {len(ids)}-token prompt, "
        f"{args.new_tokens} greedy tokens, median of {args.repeats} interleaved repeats\n"
    )
    print(
        harness.markdown_table(["decode", "decode tok/s", "vs model forward", "same tokens"], rows)
    )
    if not quantized:
        print(f"\n(float weights: kvchat's default here is the '{EXACT}' row)")
    fields: dict[str, Any] = {"rows": {row: runs[row] for row in rows_run}}

    if args.profile:
        from torch.profiler import profile

        use(rows_run[-1] if quantized else EXACT)
        stamps: list[float] = []
        prof = profile()

        def on_token(_t: int) -> None:
            stamps.append(time.perf_counter())
            if len(stamps) == 1:  # the decode steps start after the prefill's logits
                prof.start()

        with torch.inference_mode():
            common.session_reply(loaded, ids, args.new_tokens, on_token=on_token)
        prof.stop()
        steps = len(stamps) - 1
        totals = {kind: 0.0 for kind in KINDS.values()} | {"other ops": 0.0}
        for event in prof.key_averages():
            if event.key == "aten::scaled_dot_product_attention":
                continue  # the dispatcher's wrapper; its kernel is counted under its own name
            kind = next((k for key, k in KINDS.items() if key in event.key), "other ops")
            totals[kind] += event.self_cpu_time_total / 1000 / steps
        step_ms = (stamps[-1] - stamps[0]) / steps * 1000
        between = "between ops (Python, and kvchat's kernels through ctypes)"
        totals[between] = step_ms - sum(totals.values())
        totals["whole step, profiled"] = step_ms
        # The head is one module call per step; an int4 head runs kvchat's kernel through
        # ctypes, inside "between ops" above, so it is timed apart to say how much of that
        # it is (it is counted there, not added to the step).
        totals["of the step: the head alone, one row, timed apart"] = head_ms(loaded.model)
        print(f"\nwhere a step's time goes (torch profiler, {steps} steps, ms per step):\n")
        print(
            harness.markdown_table(
                ["part", "ms per step"], [[k, harness.fmt(v)] for k, v in totals.items()]
            )
        )
        fields["profile_ms_per_step"] = totals
    harness.save_run(
        args.out, "bench_decode_step", fields, harness.environment(args.threads), wall()
    )


def head_ms(model: Any, calls: int = 30) -> float:
    """Median milliseconds of the output head on one hidden row."""
    import torch

    head = model.get_output_embeddings()
    row = torch.randn(1, 1, model.config.get_text_config().hidden_size)
    with torch.inference_mode():
        head(row)  # the first call pages the weights in
        times = [harness.seconds_per_op(lambda: head(row)) for _ in range(calls)]
    return harness.median(times) * 1000


if __name__ == "__main__":
    main()
