"""Which weight-only quantization backend: kvchat's layers, torchao or optimum-quanto?

The question #11 asked ("measure, keep what wins"): the same model (the default,
SmolLM2-135M-Instruct, the GGUF's weights dequantized to float32 by kvchat's conversion), the
same ~500-token prompt of real text, 64 greedy tokens, each backend's layers in place of the
model's ``nn.Linear``s, and **the same decode loop for every row**: transformers'
``model.generate`` with a ``DynamicCache``, so that the rows differ only in the weights'
layers. One row more, last, is what kvchat ships: its default (int4) through kvchat's own
engine (the decode step, its C++ layers when built, the KV-Direct cache).

Rows (a library that is not importable, or a configuration it refuses here, is skipped with
its reason):

* ``float32``: the dequantized weights (``--weights none``), the baseline of every ratio.
* ``kvchat int4`` / ``kvchat int8``: kvchat's layers (``kvchat/engine/models/qlinear.py``) on
  torch's native CPU kernels, as ``--weights int4|int8`` loads them (int4 group 32; int8 per row,
  the vocabulary matrix int8 with float32 refinement of each row's best logits).
* ``torchao int4`` (``PrototypeInt4WeightOnlyConfig(group_size=32)``, torchao's CPU int4
  layout) and ``torchao int8`` (``Int8WeightOnlyConfig()``), on the model in bfloat16, as
  torchao's CPU examples run them; ``torchao da8w4`` (``Int8DynamicActivationInt4WeightConfig``,
  8-bit dynamic activations) where its CPU kernel is built into the installed wheel.
  ``quantize_`` replaces the decoder's ``nn.Linear``s; the output head stays bfloat16, tied
  to the embedding: the libraries' rows compare their decoder layers, the head being a
  quality choice of its own (kvchat's is int8, each row's best logits recomputed in
  float32).
* ``optimum-quanto qint8`` / ``qint4``: ``quantize(model, weights=..., exclude="lm_head")``
  + ``freeze`` on the float32 model, as the ``--weights int8`` of earlier kvchat versions did
  (the head left float32, as for torchao).

torchao and optimum-quanto are not kvchat dependencies; install them into the benchmark's
environment (``pip install torchao==0.18.0 optimum-quanto==0.2.7``; both install beside
torch 2.13.0 without pulling another torch).

Each measurement runs in a process of its own (RSS is the whole process after the reply,
peak RSS its ``VmHWM``, loading and quantizing included); repeats are interleaved, rotating
the order, and medians reported; every process runs with kvchat's thread settings
(``kvchat.threads``). Quality, in the first repeat: the first ``--quality-tokens`` tokens of
``bench_weights``' real text, teacher-forced in windows of 512: top-1 agreement with the
float32 row, and mean NLL.

Run from the repository root: ``python benchmarks/bench_backends.py [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch is imported)

from kvchat.lab import harness  # noqa: E402

FLOAT32 = "float32 (--weights none)"
SHIPPED = "kvchat default (int4) through kvchat's engine"
# row -> (loader of kvchat: dtype, weights; backend applied after loading, or None)
ROWS: dict[str, tuple[str, str, str | None]] = {
    FLOAT32: ("float32", "none", None),
    "kvchat int4": ("float32", "int4", None),
    "kvchat int8": ("float32", "int8", None),
    "torchao int4 (bf16)": ("bfloat16", "none", "torchao-int4"),
    "torchao int8 (bf16)": ("bfloat16", "none", "torchao-int8"),
    "torchao da8w4 (bf16)": ("bfloat16", "none", "torchao-da8w4"),
    "optimum-quanto qint8": ("float32", "none", "quanto-qint8"),
    "optimum-quanto qint4": ("float32", "none", "quanto-qint4"),
    SHIPPED: ("float32", "auto", None),
}
WINDOW = 512


class Skipped(Exception):
    """This backend cannot run here; the message says why."""


# -- one measurement, in a process of its own ---------------------------------------------
def apply_backend(model: Any, backend: str) -> None:
    """Replace ``model``'s linears with ``backend``'s quantized layers, in place."""
    library, _, kind = backend.partition("-")
    if library == "torchao":
        try:
            from torchao.prototype.quantization.int4 import (
                Int8DynamicActivationInt4WeightConfig,
                PrototypeInt4WeightOnlyConfig,
            )
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        except ImportError as exc:
            raise Skipped(f"torchao is not importable ({exc})") from None
        config = {
            "int4": lambda: PrototypeInt4WeightOnlyConfig(group_size=32),
            "int8": lambda: Int8WeightOnlyConfig(),
            "da8w4": lambda: Int8DynamicActivationInt4WeightConfig(group_size=32),
        }[kind]()
        import torch

        def decoder_linear(module: Any, name: str) -> bool:
            return isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")

        try:
            quantize_(model, config, filter_fn=decoder_linear)
        except (AssertionError, RuntimeError, NotImplementedError) as exc:
            raise Skipped(f"torchao refused: {str(exc).splitlines()[0]}") from None
        return
    try:
        from optimum.quanto import freeze, qint4, qint8, quantize
    except ImportError as exc:
        raise Skipped(f"optimum-quanto is not importable ({exc})") from None
    quantize(model, weights={"qint8": qint8, "qint4": qint4}[kind], exclude="lm_head")
    freeze(model)


def quality(model: Any, tokenizer: Any, n_tokens: int) -> dict[str, Any]:
    """Teacher-forced argmax per position and mean NLL over real text (``bench_weights``)."""
    import bench_weights

    ids = bench_weights.text_ids(tokenizer, n_tokens)
    logits = bench_weights.window_logits(model, ids, WINDOW)
    own = bench_weights.compare(logits, logits, ids, WINDOW)
    argmax = [int(i) for chunk in logits for i in chunk.argmax(-1)][: own["positions"]]
    return {"mean_nll": own["mean_nll"], "argmax": argmax}


def generate_reply(loaded: Any, ids: list[int], new_tokens: int) -> dict[str, Any]:
    """transformers' ``generate`` with a DynamicCache, greedy, exactly ``new_tokens``."""
    import torch
    from transformers import DynamicCache, LogitsProcessorList

    stamps: list[float] = []
    t0 = time.perf_counter()
    out = loaded.model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        cache=DynamicCache(config=loaded.model.config),
        do_sample=False,
        min_new_tokens=new_tokens,
        max_new_tokens=new_tokens,
        logits_processor=LogitsProcessorList([common.stamping_processor(stamps)]),
        pad_token_id=loaded.tokenizer.eos_token_id,
    )
    figures = common.reply_figures(len(ids), t0, stamps)
    return figures | {"tokens": [int(t) for t in out[0, len(ids) :]]}


def engine_reply(loaded: Any, ids: list[int], new_tokens: int) -> dict[str, Any]:
    """kvchat's own ``generate`` through a fresh ``ChatSession``, as the app runs it."""
    stamps: list[float] = []
    t0 = time.perf_counter()
    out = common.session_reply(
        loaded, ids, new_tokens, on_token=lambda _t: stamps.append(time.perf_counter())
    )
    return common.reply_figures(len(ids), t0, stamps) | {"tokens": list(out.tokens)}


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvchat.engine.models.load import load
    from kvchat.engine.models.quantize import weights_nbytes

    dtype, weights, backend = ROWS[name]
    loaded = load(args.model_dir, device="cpu", dtype=dtype, weights=weights,
                  threads=args.threads)  # fmt: skip
    if backend is not None:
        apply_backend(loaded.model, backend)
        harness.collect()
    ids = common.prompt_from_file(args.ids_file)
    # no_grad, not inference_mode: optimum-quanto's qint4 fails under inference_mode
    with torch.no_grad():
        reply = (engine_reply if name == SHIPPED else generate_reply)(loaded, ids, args.new_tokens)
        result = reply | {"weights_bytes": weights_nbytes(loaded.model)}
        if args.quality_tokens:
            result["quality"] = quality(loaded.model, loaded.tokenizer, args.quality_tokens)
    return result


def one(args: argparse.Namespace) -> None:
    try:
        result = measure(args.one, args)
    except Skipped as why:
        result = {"skipped": str(why)}
    print("RESULT " + json.dumps(result))


# -- the driver ------------------------------------------------------------------------------
def run_one(name: str, args: argparse.Namespace, with_quality: bool) -> dict[str, Any]:
    cmd = [
        sys.executable, __file__, "--one", name, "--model-dir", args.model_dir,
        "--ids-file", args.ids_file, "--new-tokens", str(args.new_tokens),
        "--threads", str(args.threads),
        "--quality-tokens", str(args.quality_tokens if with_quality else 0),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr or "").strip().splitlines()[-3:]
        return {"skipped": f"failed: {' | '.join(tail)}"}
    return json.loads(lines[-1].removeprefix("RESULT "))


def agreement(argmax: list[int], reference: list[int]) -> float:
    return sum(a == b for a, b in zip(argmax, reference)) / len(reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quality-tokens", type=int, default=1536)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--only", nargs="*", default=None, help="row names to run (and float32)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ids-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default="results/bench_backends.json")
    args = parser.parse_args()
    if args.threads is None:
        from kvchat.threads import default_threads

        args.threads = default_threads()
    if args.one:
        one(args)
        return

    from kvchat.engine.models.resolve import resolve_model

    wall = harness.stopwatch()
    args.model_dir = str(resolve_model(args.model).path)
    args.ids_file = common.story_prompt_file(args.model_dir, args.context, args.json)
    env = harness.environment(args.threads)
    harness.say(f"load average at start: {env['loadavg_at_start']}; threads {args.threads}")
    harness.say(common.build_native_layers())

    names = [n for n in ROWS if args.only is None or n in args.only or n == FLOAT32]
    skipped: dict[str, str] = {}

    def measure_row(name: str, repeat: int) -> dict[str, Any]:
        if name in skipped:
            return {"skipped": skipped[name]}
        result = run_one(name, args, with_quality=repeat == 0)
        if "skipped" in result:
            skipped[name] = result["skipped"]
            harness.say(f"[{repeat + 1}/{args.repeats}] {name}: skipped ({result['skipped']})")
        else:
            harness.say(
                f"[{repeat + 1}/{args.repeats}] {name}: prefill {result['prefill_tps']:.0f} "
                f"tok/s, decode {result['decode_tps']:.1f} tok/s, "
                f"RSS {harness.human_bytes(result['rss_bytes'])}"
            )
        return result

    runs = harness.interleaved(names, args.repeats, measure_row, settle=None)
    measured = [n for n in names if n not in skipped]
    keys = ("prefill_tps", "decode_tps", "rss_bytes", "peak_rss_bytes", "weights_bytes")
    med = {n: {k: harness.median([r[k] for r in runs[n]]) for k in keys} for n in measured}
    first = {n: next(r for r in runs[n] if "quality" in r) for n in measured}
    reference = first[FLOAT32]
    for n in measured:
        med[n]["top1_vs_float32"] = agreement(
            first[n]["quality"]["argmax"], reference["quality"]["argmax"]
        )
        med[n]["mean_nll"] = first[n]["quality"]["mean_nll"]
        med[n]["same_greedy_tokens_as_float32"] = first[n]["tokens"] == reference["tokens"]

    base = med[FLOAT32]
    headers = ["weights", "decode tok/s", "decode vs float32", "prefill tok/s",
               "prefill vs float32", "weights", "RSS", "peak RSS", "top-1 = float32",
               "mean NLL"]  # fmt: skip
    rows = []
    for n in measured:
        m = med[n]
        rows.append([
            n, f"{m['decode_tps']:.1f}", harness.fmt(m["decode_tps"] / base["decode_tps"]),
            f"{m['prefill_tps']:.0f}", harness.fmt(m["prefill_tps"] / base["prefill_tps"]),
            harness.human_bytes(m["weights_bytes"]), harness.human_bytes(m["rss_bytes"]),
            harness.human_bytes(m["peak_rss_bytes"]),
            f"{m['top1_vs_float32'] * 100:.2f} %", f"{m['mean_nll']:.4f}",
        ])  # fmt: skip
    positions = len(reference["quality"]["argmax"])
    print(
        f"SmolLM2-135M-Instruct, {args.context}-token prompt, {args.new_tokens} greedy tokens "
        f"through model.generate (last row: kvchat's engine), {args.threads} threads, medians "
        f"of {args.repeats} interleaved runs, one process each; quality over {positions} "
        "positions of real text"
    )
    print(harness.markdown_table(headers, rows))
    for n, why in skipped.items():
        print(f"{n}: skipped ({why})")
    try:
        print(f"load average: start {env['loadavg_at_start']}, end {os.getloadavg()}")
    except OSError:
        pass
    fields = {"runs": runs, "medians": med, "skipped": skipped}
    harness.save_run(args.json, "bench_backends", fields, env, wall())


if __name__ == "__main__":
    main()
