"""Bounded mode against DynamicCache: decode speed under a ceiling, warm and cold disk.

Question: how much of DynamicCache's decode speed does kvchat keep when its conversation
state is held under ``--max-mem`` (the rest on disk), with identical greedy tokens?

Rows (SmolLM2-135M fp32, 2 threads, greedy; each a ratio against DynamicCache in the same
run, decoded step by step in turn with it):

* 2K context, ceiling 25 % of the standard cache (target >= 0.6x)
* 8K context, ceiling 25 % (target >= 0.5x)
* 8K context, ``--max-mem 2MB`` (target >= 0.25x; attention streamed)
* each with ``--checkpoint auto`` (K/V form here) and ``--checkpoint residual`` (the paper's)
* ``--gemma``: a Gemma-3-4B-shaped model (the bundled config, random bf16 weights run as
  int4 with bf16 compute, kvchat's default on CPU), 4K context, ``--max-mem 64MB``
  (target >= 0.8x)

Every row is measured twice: with the page cache warm, and with it dropped for the
conversation's files (segments and spill files, ``POSIX_FADV_DONTNEED`` after a sync)
before every step, which is what a cold disk gives.

How the state is built: one conversation is saved without a ceiling (K/V form) and one as
residuals, each from the same prompt; every bounded row *resumes* it under its ceiling (the
conversation's files are its disk tier), while the baseline prefilled the same tokens into
a DynamicCache with the same chunks. The SmolLM2 prompt is text (warehouse notes), so the
reply tokens are real; the Gemma prompt is seeded random token ids.

    python benchmarks/bench_bounded.py            # SmolLM2 rows (~10 min here)
    python benchmarks/bench_bounded.py --quick    # 1K context, fewer steps (~2 min)
    python benchmarks/bench_bounded.py --gemma    # also the Gemma-3-4B-shaped row (~8 GB RAM)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch loads)
from common import user_text  # noqa: E402

from kvchat.lab import harness  # noqa: E402

TARGETS = {("2K", "25%"): 0.6, ("8K", "25%"): 0.5, ("8K", "2MB"): 0.25, ("4K", "64MB"): 0.8}
COLD_TARGETS = {("8K", "25%"): 0.5}  # read back from a cold disk


def drop_page_cache(root: Path) -> None:
    """Sync and drop every file under ``root`` from the page cache (a cold disk)."""
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        try:
            harness.drop_pages(path)
        except OSError:
            continue


def decode_pair(loaded: Any, base: Any, bounded: Any, token: int, steps: int, cold: Path | None):
    """Decode ``steps`` tokens on both caches in turn; step times and tokens of each."""
    import torch

    sessions = {"standard": base, "bounded": bounded}
    state = {"standard": token, "bounded": token}
    times: dict[str, list[float]] = {"standard": [], "bounded": []}
    tokens: dict[str, list[int]] = {"standard": [], "bounded": []}
    with torch.inference_mode():
        for step in range(steps):
            for name in harness.rotated(list(sessions), step):
                if cold is not None and name == "bounded":
                    drop_page_cache(cold)
                state[name], seconds = common.timed_step(loaded, sessions[name], state[name])
                times[name].append(seconds)
                tokens[name].append(state[name])
    return times, tokens


def smollm2_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvchat.engine.chat.conversation import open_session
    from kvchat.engine.chat.settings import CacheSettings, SamplingSettings

    loaded = common.load_model(args.model, "float32")
    rows = []
    contexts = [("1K", 1024)] if args.quick else [("2K", 2048), ("8K", 8192)]
    for label, n in contexts:
        text, n_prompt = user_text(loaded, n, seed=0)
        harness.say(f"{label}: {n_prompt}-token prompt")
        one = SamplingSettings(max_new_tokens=1)
        root = Path(tempfile.mkdtemp(prefix="kvchat-bench-bounded-"))
        base = open_session(loaded, data_dir=root, cache=CacheSettings(kind="standard"), save=False)
        first = base.send(text, one).tokens[-1]
        saved = {}
        for form, settings in (
            ("auto", CacheSettings()),
            ("residual", CacheSettings(max_mem=10**12, checkpoint="residual")),
        ):
            s = open_session(loaded, data_dir=root, cache=settings)
            assert s.send(text, one).tokens[-1] == first
            saved[form] = s.conversation.id
            s.close()
        standard_bytes = loaded.footprint.standard_cache_bytes(n_prompt)
        ceilings = [("25%", standard_bytes // 4)]
        if not args.quick:
            ceilings.append(("2MB", 2 * 10**6))
        for cname, ceiling in ceilings:
            for form in ("auto", "residual"):
                for cold in (False, True):
                    if form == "residual" and cname == "2MB" and not args.all:
                        continue  # minutes per token: residual recompute of 8K from disk
                    settings = CacheSettings(max_mem=ceiling, checkpoint=form)
                    bounded = open_session(
                        loaded, data_dir=root, cache=settings, conversation_id=saved[form]
                    )
                    reference = open_session(
                        loaded, data_dir=root, cache=CacheSettings(kind="standard"), save=False
                    )
                    reference.send(text, one)
                    times, tokens = decode_pair(
                        loaded, reference, bounded, first, args.steps, root if cold else None
                    )
                    mem = bounded.memory()
                    bounded.close()
                    reference.close()
                    harness.collect()
                    rows.append(row(label, cname, form, cold, times, tokens, mem))
                    harness.say(f"  {rows[-1]['summary']}")
        base.close()
    return rows


def random_bf16_model(config: Any) -> Any:
    """``config``'s model with seeded random bf16 weights (norms zero: Gemma scales by 1 + w).
    Built on the meta device and filled tensor by tensor: transformers' own initialisation
    of 4B parameters takes many minutes on 2 cores."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvchat.engine.models.meta_init import parameters_on_meta

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    made: dict[int, torch.nn.Parameter] = {}  # a tied parameter is filled once, shared
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                values = torch.empty(param.shape, dtype=torch.bfloat16)
                if name == "weight" and "norm" in type(module).__name__.lower():
                    values.zero_()
                else:
                    values.normal_(0.0, 0.02, generator=generator)
                made[id(param)] = torch.nn.Parameter(values, requires_grad=False)
            module._parameters[name] = made[id(param)]
    model.tie_weights()
    return model.eval()


def gemma_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from kvchat.engine.chat.generate import prefill
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.chat.settings import CacheSettings
    from kvchat.engine.kvdirect.footprint import (
        bundled_config_dict,
        config_from_dict,
        footprint_from_config,
    )
    from kvchat.engine.models.loaded import LoadedModel
    from kvchat.engine.models.quantize import quantize_weights, weights_nbytes

    config = config_from_dict(bundled_config_dict("gemma-3-4b")).get_text_config()
    harness.say("building a Gemma-3-4B-shaped model with random bf16 weights, then int4")
    # int4 is what kvchat runs a bf16 checkpoint with on CPU by default (and bf16 matmuls
    # without AVX512-BF16 run at a fifth of int4's speed: a 4K prefill would take an hour).
    model = quantize_weights(random_bf16_model(config), "int4")
    fp = footprint_from_config(model.config, "bfloat16")
    loaded = LoadedModel(
        model, None, "gemma-3-4b (random)", torch.device("cpu"), "bfloat16",
        weights_nbytes(model), fp, weights_mode="int4",
    )  # fmt: skip
    n = 1024 if args.quick else 4096
    ids = torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    ids = ids.tolist()
    rows = []
    root = Path(tempfile.mkdtemp(prefix="kvchat-bench-gemma-"))
    base = ChatSession(loaded, cache=CacheSettings(kind="standard"))  # a DynamicCache
    bounded = ChatSession(loaded, cache=CacheSettings(max_mem=64 * 10**6), spill_root=root)
    with torch.inference_mode():
        t0 = time.perf_counter()
        first = int(torch.argmax(prefill(model, base.cache, ids, loaded.device, 256)))
        harness.say(f"  standard prefill {time.perf_counter() - t0:.0f} s")
        t0 = time.perf_counter()
        logits = prefill(model, bounded.cache, ids, loaded.device, 256)
        harness.say(f"  bounded prefill {time.perf_counter() - t0:.0f} s")
    assert int(torch.argmax(logits)) == first
    token = first
    for cold in (False, True):  # the same two sessions go on decoding, warm then cold
        times, tokens = decode_pair(
            loaded, base, bounded, token, args.steps, root if cold else None
        )
        token = tokens["bounded"][-1]
        label = "4K" if n == 4096 else "1K"
        rows.append(row(label, "64MB", "auto", cold, times, tokens, bounded.memory()))
        harness.say(f"  {rows[-1]['summary']}")
    bounded.close()
    return rows


def row(context, ceiling, form, cold, times, tokens, mem) -> dict[str, Any]:
    ratio = harness.median_ratio(times["standard"], times["bounded"])
    target = (COLD_TARGETS if cold else TARGETS).get((context, ceiling))
    same = tokens["standard"] == tokens["bounded"]
    out = {
        "context": context,
        "ceiling": ceiling,
        "checkpoint": form,
        "disk": "cold" if cold else "warm",
        "decode_ratio": round(ratio, 3),
        "standard_step_ms": round(1000 * harness.median(times["standard"]), 1),
        "bounded_step_ms": round(1000 * harness.median(times["bounded"]), 1),
        "same_tokens": same,
        "resident_bytes": mem.state_bytes,
        "standard_equivalent_bytes": mem.standard_equivalent_bytes,
        "disk_bytes": mem.disk_bytes,
        "disk_vs_standard": round(mem.disk_bytes / max(1, mem.standard_equivalent_bytes), 3),
        "plan": mem.plan,
        "target": target,
        "meets_target": None if target is None or form != "auto" else ratio >= target,
    }
    out["summary"] = (
        f"{context} {ceiling} {form} {out['disk']}: {ratio:.2f}x "
        f"({out['bounded_step_ms']} vs {out['standard_step_ms']} ms/step), same tokens {same}, "
        f"disk {out['disk_vs_standard']:.2f}x the standard cache's bytes"
        + ("" if target is None else f" (target >= {target}x)")
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gemma", action="store_true", help="add the Gemma-3-4B-shaped row")
    parser.add_argument("--gemma-only", action="store_true")
    parser.add_argument("--all", action="store_true", help="also residual form under 2MB")
    parser.add_argument("--out", default="results/bench_bounded.json")
    args = parser.parse_args(argv)
    args.steps = args.steps or (6 if args.quick else 12)
    wall = harness.stopwatch()
    common.set_threads(args.threads)
    env = harness.environment(args.threads)
    rows = [] if args.gemma_only else smollm2_rows(args)
    if args.gemma or args.gemma_only:
        rows += gemma_rows(args)
    headers = ["context", "ceiling", "checkpoint", "disk", "decode vs DynamicCache",
               "ms/step (bounded / standard)", "same tokens", "resident / standard", "on disk",
               "target"]  # fmt: skip
    table = [
        [r["context"], r["ceiling"], r["checkpoint"], r["disk"], f"{r['decode_ratio']:.2f}x",
         f"{r['bounded_step_ms']} / {r['standard_step_ms']}", "yes" if r["same_tokens"] else "NO",
         f"{harness.human_bytes(r['resident_bytes'])} / "
         f"{harness.human_bytes(r['standard_equivalent_bytes'])}",
         harness.human_bytes(r["disk_bytes"]),
         "" if r["target"] is None else f">= {r['target']}x"
         + ("" if r["meets_target"] is None else (" met" if r["meets_target"] else " MISSED"))]
        for r in rows
    ]  # fmt: skip
    print(harness.markdown_table(headers, table))
    harness.save_run(args.out, "bench_bounded", {"rows": rows}, env, wall())
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
