"""The int8 output head: kvchat's kernel (``engine/models/int8_kernel.c``, float32
activations and logits) against what the head ran before it, torch's
``_weight_int8pack_mm`` (bf16 activations and logits) with each row's 16 best logits
recomputed in float32 (``qlinear.Int8Linear``'s fallback).

Heads (random int8 weights, per-row scales): the default model's tied vocabulary (SmolLM2,
49,152 x 576), Gemma 3 270M's (262,144 x 640) and Qwen2.5 0.5B's (151,936 x 896), at one
row (a decode step) and 8 rows. Interleaved runs in this process, on the head's thread
count; ratio = torch's time / the kernel's (above 1: the kernel is faster). GB/s counts the
int8 weights one call reads; "read GB/s" is a plain read of as many bytes (``torch.sum``
over float32) timed in the same run, the most a one-row call could reach. "max error" is
each head's largest distance from the float64 product, against the largest logit.

A second table: what it buys a whole decode step. The default model (or ``--model``) as the
engine holds it (``--weights auto``: int4 layers, int8 head), the ~500-token prompt of
``bench_peers.py`` and 64 greedy tokens, decoded with each head in turn (interleaved, same
process); ratio = the torch head's seconds per token / the kernel head's, paired per
repeat; the greedy tokens must be the same.

Run from the repository root: ``python benchmarks/bench_int8_head.py [--repeats 7] [--model
gemma-3-270m]``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (this checkout's kvchat first on sys.path)

from kvchat.lab import harness  # noqa: E402

HEADS = [
    ("default model (SmolLM2-135M)", 49152, 576),
    ("Gemma 3 270M", 262144, 640),
    ("Qwen2.5 0.5B", 151936, 896),
]


def main() -> None:
    import torch

    from kvchat.engine.models import int8_kernel, qlinear

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", default=common.DEFAULT_MODEL, help="for the decode table")
    parser.add_argument("--out", default="docs/results/bench_int8_head/run.json")
    args = parser.parse_args()
    if not int8_kernel.available():
        sys.exit("kvchat's int8 kernel is not built here (no C compiler?): nothing to compare")
    wall = harness.stopwatch()
    env = harness.environment(threads=torch.get_num_threads())
    rows = []
    print(f"{torch.get_num_threads()} threads")
    print(
        "| head | rows | kernel ms | GB/s | read GB/s | torch + refine ms | ratio "
        "| max error, kernel | max error, torch |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, n, k in HEADS:
        g = torch.Generator().manual_seed(0)
        parts = qlinear.quantize_int8(torch.randn(n, k, generator=g) * 0.05)
        ours_head = qlinear.Int8Linear(parts, None, qlinear.HEAD_REFINE_TOP)
        torch_head = qlinear.Int8Linear(parts, None, qlinear.HEAD_REFINE_TOP)
        torch_head.head_scales = None  # torch's kernel, its best 16 refined in float32
        scales = parts["scales"]
        plain = torch.ones(parts["qweight"].nbytes // 4)
        for m in (1, 8):
            x = torch.randn(m, k, generator=g)
            ours, theirs = functools.partial(ours_head, x), functools.partial(torch_head, x)
            with torch.inference_mode():
                ours_s, theirs_s = common.alternating_timings(ours, theirs, args.repeats, 5)
                read_s, _ = common.alternating_timings(plain.sum, plain.sum, 3, 5)
                expected = x.double() @ (parts["qweight"].double() * scales.double()[:, None]).T
                top = expected.abs().max()
                err_ours = float((ours().double() - expected).abs().max() / top)
                err_theirs = float((theirs().double() - expected).abs().max() / top)
            k_ms, t_ms = harness.median(ours_s) * 1e3, harness.median(theirs_s) * 1e3
            gbs = parts["qweight"].nbytes / (k_ms / 1e3) / 1e9
            read_gbs = parts["qweight"].nbytes / harness.median(read_s) / 1e9
            ratio = harness.median_ratio(theirs_s, ours_s)
            rows.append(
                {"head": name, "out": n, "in": k, "rows": m, "kernel_ms": k_ms,
                 "kernel_gb_per_s": gbs, "read_gb_per_s": read_gbs, "torch_ms": t_ms,
                 "ratio": ratio, "max_error_kernel": err_ours, "max_error_torch": err_theirs}
            )  # fmt: skip
            print(
                f"| {name} ({n}x{k}) | {m} | {k_ms:.2f} | {gbs:.1f} | {read_gbs:.1f} "
                f"| {t_ms:.2f} | {ratio:.2f} | {err_ours:.1e} | {err_theirs:.1e} |"
            )
    model_row = model_table(args.model, args.repeats)
    harness.save_run(
        args.out, "bench_int8_head", {"args": vars(args), "rows": rows, "model": model_row},
        env, wall(),
    )  # fmt: skip


def model_table(model: str, repeats: int) -> dict:
    """``model``'s decode with the kernel's head and with torch's, interleaved."""
    from transformers import AutoTokenizer

    from kvchat.engine.models import qlinear
    from kvchat.engine.models.decode_step import decode_step_for
    from kvchat.engine.models.load import load
    from kvchat.engine.models.resolve import resolve_model
    from kvchat.lab.texts import STORY

    path = str(resolve_model(model).path)
    loaded = load(path, device="cpu", dtype="auto", weights="auto")
    step = decode_step_for(loaded.model)
    if step is not None:
        step.wait_for_native(600)
    ids = AutoTokenizer.from_pretrained(path)(STORY, add_special_tokens=False)["input_ids"][:500]
    head = loaded.model.get_output_embeddings()
    if not isinstance(head, qlinear.Int8Linear) or head.head_scales is None:
        harness.say(f"{model}'s head does not run the kernel here: no decode table")
        return {}
    kernel_scales = head.head_scales
    heads = {"kernel head": kernel_scales, "torch head (before)": None}

    def measure(row: str, rep: int) -> dict:
        head.head_scales = heads[row]
        result = common.decode_rate(loaded, ids, 64)
        harness.say(f"[{rep + 1}/{repeats}] {row}: decode {result['decode_tok_s']:.1f} tok/s")
        return result

    runs = harness.interleaved(list(heads), repeats, measure)
    head.head_scales = kernel_scales
    same = all(a["tokens"] == b["tokens"] for a, b in zip(*runs.values()))
    tps = {row: harness.median(r["decode_tok_s"] for r in rs) for row, rs in runs.items()}
    ratio = harness.median_ratio(
        runs["torch head (before)"], runs["kernel head"], "seconds_per_token"
    )
    print(f"\n| {model} ({loaded.weights_mode} weights), {len(ids)}-token prompt "
          "| kernel head tok/s | torch head tok/s | ratio | same tokens |")  # fmt: skip
    print("|---|---|---|---|---|")
    figures = f"{tps['kernel head']:.1f} | {tps['torch head (before)']:.1f} | {ratio:.2f}"
    print(f"| decode, medians of {repeats} | {figures} | {'yes' if same else 'NO'} |")
    return {"model": model, "decode_tok_s": tps, "ratio": ratio, "same_tokens": same}


if __name__ == "__main__":
    main()
