"""Weight modes against the dequantized float32 weights: quality and memory.

For each mode (``--dtype bfloat16``, ``--weights int8``, ``--weights int4``) the same text is
fed teacher-forced in windows of ``--window`` tokens, and each position's logits are compared
with float32's (the GGUF's weights dequantized, i.e. what ``--weights none`` runs):

* top-1 agreement: the fraction of positions whose argmax equals float32's;
* mean NLL of the text's actual next token (nats), beside float32's own;
* weights: resident bytes of the weights as loaded.

The text is real prose, none of it generated: ``kvchat.lab.texts`` (a story, meeting notes)
then this repository's README, cut at ``--tokens`` tokens.

The last row keeps int4 weights and holds K/V in bfloat16 (``--kv-dtype bfloat16``: kvchat's
standard cache rounds each K/V row once as it stores it, and attention reads the rounded
numbers, as llama.cpp's f16 cache does), for what half the state's bytes cost in quality.

Run from the repository root: ``python benchmarks/bench_weights.py [--tokens 3072]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch is imported)

from kvchat.lab import harness  # noqa: E402

KV_BF16 = "int4 + --kv-dtype bfloat16"
MODES = (
    ("float32 (--weights none)", "float32", "none"),
    ("bfloat16 (--dtype bfloat16)", "bfloat16", "none"),
    ("int8 (--weights int8)", "float32", "int8"),
    ("int4 (--weights int4)", "float32", "int4"),
    # what --weights auto --dtype auto run for a bfloat16 checkpoint
    ("int4 + bfloat16 compute (auto, bf16 checkpoint)", "bfloat16", "int4"),
    (KV_BF16, "float32", "int4"),
)


def text_ids(tokenizer: Any, n_tokens: int) -> list[int]:
    from kvchat.lab import texts

    parts = [texts.STORY, texts.NOTES, (common.REPO_ROOT / "README.md").read_text("utf-8")]
    ids = tokenizer("\n\n".join(parts), add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        harness.say(f"only {len(ids)} tokens of text; using them all")
    return ids[:n_tokens]


def window_logits(model: Any, ids: list[int], window: int, kv_cache: Any = None) -> list[Any]:
    """Each window's logits, fed alone; ``kv_cache()``: a new cache for each window."""
    import torch

    out = []
    # no_grad, not inference_mode: bench_backends runs this on optimum-quanto's qint4 layers,
    # which fail under inference_mode (the logits are the same either way)
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : start + window]])
            kwargs = {}
            if kv_cache is not None:
                kwargs["past_key_values"] = kv_cache()
            out.append(model(input_ids=chunk, **kwargs).logits[0].float())
    return out


def compare(reference: list[Any], logits: list[Any], ids: list[int], window: int) -> dict:
    import torch

    agree = total = 0
    nll = 0.0
    for n, (ref, got) in enumerate(zip(reference, logits)):
        start = n * window
        targets = torch.tensor(ids[start + 1 : start + 1 + got.shape[0]])
        got = got[: len(targets)]
        ref = ref[: len(targets)]
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(targets)
        nll += float(torch.nn.functional.cross_entropy(got, targets, reduction="sum"))
    return {"top1_agreement": agree / total, "mean_nll": nll / total, "positions": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=3072)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default="results/bench_weights.json")
    parser.add_argument(
        "--no-tiles",
        action="store_true",
        help="int4 prefill on the one-row vector path (KVCHAT_INT4_TILES=0): what the tiled "
        "path changes in quality",
    )
    args = parser.parse_args()
    if args.no_tiles:
        import os

        os.environ["KVCHAT_INT4_TILES"] = "0"

    from kvchat.engine.models.load import load
    from kvchat.engine.models.resolve import resolve_model

    path = str(resolve_model(args.model).path)
    wall = harness.stopwatch()
    env = harness.environment(args.threads or 0)
    harness.say(f"load average at start: {env['loadavg_at_start']}")
    rows, results, reference, ids = [], {}, None, None
    for label, dtype, weights in MODES:
        elapsed = harness.stopwatch()
        loaded = load(path, device="cpu", dtype=dtype, weights=weights, threads=args.threads)
        harness.say(f"{label}: loaded in {elapsed():.1f} s")
        if ids is None:
            ids = text_ids(loaded.tokenizer, args.tokens)
        elapsed = harness.stopwatch()
        kv_cache = None
        if label == KV_BF16:
            from kvchat.engine.kvdirect.standard import StandardCache

            held = loaded.footprint.with_kv_dtype("bfloat16")

            def kv_cache(loaded=loaded, held=held) -> Any:
                return StandardCache(loaded.model.config, held, None)

        logits = window_logits(loaded.model, ids, args.window, kv_cache)
        seconds = elapsed()
        if reference is None:
            reference = logits
        result = compare(reference, logits, ids, args.window)
        result.update(weights_bytes=loaded.weights_bytes, teacher_forced_seconds=seconds)
        results[label] = result
        rows.append(
            [
                label,
                f"{result['top1_agreement'] * 100:.2f} %",
                f"{result['mean_nll']:.4f}",
                harness.human_bytes(loaded.weights_bytes),
                f"{seconds:.1f} s",
            ]
        )
        del loaded, logits
        harness.collect()
    print(f"{results[MODES[0][0]]['positions']} positions of real text, windows of {args.window}")
    print(
        harness.markdown_table(
            ["weights", "top-1 = float32", "mean NLL (nats)", "weights", "teacher-forced"], rows
        )
    )
    try:
        import os

        print(f"load average at end: {os.getloadavg()}")
    except OSError:
        pass
    harness.save_run(args.json, "bench_weights", {"results": results}, env, wall())


if __name__ == "__main__":
    main()
