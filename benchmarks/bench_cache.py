"""KV-Direct cache: decode speed and resident conversation state vs DynamicCache, per budget.

For each context length (``--contexts``, default 2048 and 8192; ``--quick``: 512 and 1024)
and each hot window B (all tokens, 25 % of the context, 64) and checkpoint form (residual,
kv, auto), a ``ChatSession(CacheSettings(hot_window=B, checkpoint=form))`` is built, its
cache prefilled with the context (chunks of 256, as the engine does) and ``--new-tokens``
greedy tokens decoded with no early stop, by ``kvchat.engine.chat.generate.generate`` on
the session's cache (how the session drives it: the cache prepares each call itself). The
baseline is a ``CacheSettings(kind="standard")`` session, i.e. transformers'
``DynamicCache``, driven by the same loop in the same run, so the ratios isolate the cache.

Per configuration it reports:

* prefill and decode tokens/s, and the decode ratio vs DynamicCache (baseline time / time,
  paired per repeat; > 1 is faster);
* the share of decode time spent recomputing K/V (``cache.stats.recompute_seconds`` counted
  over the decode steps only, over the decode time);
* the peak resident conversation state: the session's memory snapshot ``state_bytes`` after
  the run (hot K/V + checkpoints + peak recompute scratch + token ids; it only grows during a
  run, scratch being tracked as a peak), against ``standard_equivalent_bytes`` (what
  DynamicCache would hold, from the footprint) and against the K/V bytes the baseline's
  DynamicCache actually held;
* whether the greedy tokens equal the DynamicCache run's (KV-Direct promises identical
  output at every budget).

Every configuration is prefilled on its own (a prefilled state cannot be shared across cache
types). Configurations that build the very same cache are measured once and their rows say
so (``= B=all kv``): B only acts on residual-form layers, and ``auto`` on SmolLM2 (GQA: K+V
1.5 KiB < residual 2.25 KiB per layer in fp32) picks kv at every layer; ``--all-configs``
measures them separately anyway. After the last repeat, the configurations that evict nothing
and the baseline decode ``--interleaved-steps`` more tokens one step each in turn, and the
median paired step ratio is reported beside the whole-run ratios: under CPU contention it is
the steadiest of the three.

``B = all`` means ``hot_window`` = every token the run feeds (context + new tokens +
interleaved steps): nothing is ever evicted, but the residual form still captures and holds
every checkpoint; its decode speed must be within 5 % of DynamicCache, which is checked and
printed for both the whole-run and the step-interleaved ratio.

Run from the repository root: ``python benchmarks/bench_cache.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch is imported)

from kvchat.lab import harness  # noqa: E402
from kvchat.lab.prompts import seeded_ids  # noqa: E402

FORMS = ("residual", "kv", "auto")
BUDGETS = ("all", "25%", "64")
BASELINE = "DynamicCache"
B_ALL_TOLERANCE = 0.95
CHUNK = 256


def hot_window(budget: str, context: int, total_tokens: int) -> int:
    """B for a budget label; ``all`` = every token the run will ever feed."""
    if budget == "all":
        return total_tokens
    if budget.endswith("%"):
        return context * int(budget[:-1]) // 100
    return int(budget)


def storage_bytes_held(cache: Any) -> int:
    """Bytes of every distinct storage the cache references (cross-checks the snapshot)."""
    seen: dict[int, int] = {}
    for layer in cache.layers:
        tensors = [layer.keys, layer.values] + [c.residual for c in getattr(layer, "calls", [])]
        for t in tensors:
            if t is not None and t.numel():
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def forms_label(cache: Any) -> str:
    counts = Counter(getattr(layer, "form", "kv") for layer in cache.layers)
    return "+".join(f"{form}x{n}" for form, n in sorted(counts.items()))


def run_config(
    loaded: Any,
    prompt: list[int],
    new_tokens: int,
    budget: str | None,
    form: str | None,
    keep: bool = False,
    total_tokens: int | None = None,
) -> dict[str, Any]:
    """Prefill ``prompt`` then decode ``new_tokens`` with one cache configuration.

    With ``keep`` the (detached) session is returned under ``"session"`` for the
    step-interleaved phase, which continues decoding from where this run stopped.
    """
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.chat.settings import CacheSettings

    if budget is None:
        settings = CacheSettings(kind="standard", prefill_chunk=CHUNK)
    else:
        settings = CacheSettings(
            hot_window=hot_window(budget, len(prompt), total_tokens or len(prompt) + new_tokens),
            checkpoint=form,
            prefill_chunk=CHUNK,
        )
    session = ChatSession(loaded, cache=settings)
    cache = session.cache
    stats = getattr(cache, "stats", None)
    at_decode: dict[str, float] = {}

    def after_prefill() -> None:
        at_decode["recompute_seconds"] = stats.recompute_seconds
        at_decode["recomputed_tokens"] = stats.recomputed_tokens
        at_decode["scratch_peak_bytes"] = stats.scratch_peak_bytes

    try:
        outcome, steps = common.stamped_generate(
            loaded, session, prompt, new_tokens, CHUNK, after_prefill if stats is not None else None
        )
        session.token_ids = list(prompt) + list(outcome.tokens)
        mem = session.memory()
        held = storage_bytes_held(cache)
        label = forms_label(cache)
    finally:
        session.close()

    extra = {"session": session, "next_token": outcome.tokens[-1]} if keep else {}
    recompute_total = stats.recompute_seconds if stats is not None else 0.0
    recompute_prefill = at_decode.get("recompute_seconds", recompute_total)
    recompute_decode = recompute_total - recompute_prefill
    return {
        "prefill_seconds": outcome.prefill_seconds,
        "decode_seconds": outcome.decode_seconds,
        "step_median_seconds": harness.median(steps),
        "recompute_prefill_seconds": recompute_prefill,
        "recompute_decode_seconds": recompute_decode,
        "recomputed_tokens_decode": (
            stats.recomputed_tokens - at_decode.get("recomputed_tokens", 0) if stats else 0
        ),
        "scratch_peak_prefill_bytes": at_decode.get("scratch_peak_bytes", 0),
        "forms": label,
        "hot_window": mem.hot_window,
        "memory": {
            k: v for k, v in mem.to_dict().items() if k.endswith("_bytes") or k.endswith("tokens")
        },
        "storage_bytes_held": held,
        "tokens": outcome.tokens,
        **extra,
    }


def measure_context(
    loaded: Any,
    context: int,
    new_tokens: int,
    repeats: int,
    seed: int,
    lock_steps: int,
    all_configs: bool = False,
) -> dict[str, Any]:
    from kvchat.engine.kvdirect.planner import choose_forms

    prompt = seeded_ids(loaded, context, seed)
    total = context + new_tokens + lock_steps
    configs: list[tuple[str, str | None, str | None]] = [(BASELINE, None, None)]
    for budget in BUDGETS:
        for form in FORMS:
            configs.append((f"B={budget} {form}", budget, form))

    # Configurations that build the very same cache are measured once unless --all-configs.
    same_as: dict[str, str] = {}
    evicts: dict[str, bool] = {}
    first_by_key: dict[Any, str] = {}
    for name, budget, form in configs:
        if budget is None:
            key: Any = ("standard",)
        else:
            forms = tuple(choose_forms(loaded.footprint, form))
            acts = "residual" in forms
            key = (forms, hot_window(budget, context, total) if acts else None)
            evicts[name] = acts and budget != "all"
        if key in first_by_key and not all_configs:
            same_as[name] = first_by_key[key]
        else:
            first_by_key.setdefault(key, name)
    measured = [c for c in configs if c[0] not in same_as]
    # Step-interleaved phase: the configurations that evict nothing (the B = all check);
    # the ones that recompute are several times slower, whole-run ratios show them well.
    interleave = {name for name, _, _ in measured if not evicts.get(name, False)}

    spec = {name: (budget, form) for name, budget, form in measured}
    kept: dict[str, Any] = {}

    def measure(name: str, rep: int) -> dict[str, Any]:
        keep = rep == repeats - 1 and lock_steps > 0 and name in interleave
        budget, form = spec[name]
        elapsed = harness.stopwatch()
        r = run_config(loaded, prompt, new_tokens, budget, form, keep=keep, total_tokens=total)
        if keep:
            kept[name] = (r.pop("session"), r.pop("next_token"))
        harness.say(
            f"  ctx {context} repeat {rep + 1}/{repeats} {name:16s} "
            f"prefill {r['prefill_seconds']:6.1f}s decode "
            f"{(new_tokens - 1) / r['decode_seconds']:6.2f} tok/s "
            f"recompute {r['recompute_decode_seconds']:6.2f}s "
            f"({elapsed():.0f}s)"
        )
        return r

    runs = harness.interleaved(spec, repeats, measure)

    interleaved = None
    if kept:
        harness.say(
            f"  ctx {context}: {lock_steps} step-interleaved decode rounds over "
            f"{', '.join(kept)} ..."
        )
        interleaved = common.interleaved_decode(loaded, kept, lock_steps)
        kept.clear()
        harness.collect()

    steps = new_tokens - 1
    base = runs[BASELINE]
    dynamic_kv_bytes = harness.median([r["memory"]["hot_kv_bytes"] for r in base])
    summary: dict[str, Any] = {}
    for name, budget, form in measured:
        rs = runs[name]
        decode_tps = [steps / r["decode_seconds"] for r in rs]
        decode_ratio = harness.paired_ratios(base, rs, "decode_seconds")
        step_ratio = harness.paired_ratios(base, rs, "step_median_seconds")
        prefill_ratio = harness.paired_ratios(base, rs, "prefill_seconds")
        share = [r["recompute_decode_seconds"] / r["decode_seconds"] for r in rs]
        lock = None
        if interleaved is not None and name in interleaved["step_seconds"]:
            times = interleaved["step_seconds"]
            lock = {
                "steps": lock_steps,
                "step_median_ms": 1000 * harness.median(times[name]),
                "decode_tokens_per_s": 1 / harness.median(times[name]),
                "paired_ratio": harness.median_ratio(times[BASELINE], times[name]),
                "tokens_match": interleaved["tokens"][name] == interleaved["tokens"][BASELINE],
            }
        mem = rs[-1]["memory"]  # deterministic: identical in every repeat
        state = mem["state_bytes"]
        summary[name] = {
            "budget": budget,
            "form": form,
            "same_as": None,
            "forms": rs[-1]["forms"],
            "hot_window": rs[-1]["hot_window"],
            "prefill_tokens_per_s": harness.median([context / r["prefill_seconds"] for r in rs]),
            "prefill_ratio": harness.median(prefill_ratio),
            "decode_tokens_per_s": harness.median(decode_tps),
            "decode_ratio": harness.median(decode_ratio),
            "step_median_ratio": harness.median(step_ratio),
            "decode_spread": harness.spread(decode_tps),
            "recompute_share_of_decode": harness.median(share),
            "recompute_decode_seconds": harness.median([r["recompute_decode_seconds"] for r in rs]),
            "recompute_prefill_seconds": harness.median(
                [r["recompute_prefill_seconds"] for r in rs]
            ),
            "recomputed_tokens_decode": rs[-1]["recomputed_tokens_decode"],
            "memory": mem,
            "storage_bytes_held": rs[-1]["storage_bytes_held"],
            "state_vs_standard_equivalent": state / mem["standard_equivalent_bytes"],
            "state_vs_dynamic_cache": state / dynamic_kv_bytes,
            "dynamic_cache_kv_bytes": dynamic_kv_bytes,
            "tokens_match_dynamic_cache": all(r["tokens"] == b["tokens"] for r, b in zip(rs, base))
            and (lock is None or lock["tokens_match"]),
            "interleaved": lock,
            "per_repeat": [
                {k: v for k, v in r.items() if k not in ("tokens", "memory")}
                | {"decode_ratio": dr, "step_median_ratio": sr}
                for r, dr, sr in zip(rs, decode_ratio, step_ratio)
            ],
        }
    ordered: dict[str, Any] = {}
    for name, budget, form in configs:
        if name in same_as:
            ordered[name] = dict(summary[same_as[name]], budget=budget, form=form)
            ordered[name]["same_as"] = same_as[name]
            ordered[name]["hot_window"] = hot_window(budget, context, total)
            ordered[name]["per_repeat"] = []
        else:
            ordered[name] = summary[name]
    return {
        "context": context,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "interleaved_steps": lock_steps,
        "configs": ordered,
    }


def print_context(result: dict[str, Any], model: str, threads: int) -> list[dict[str, Any]]:
    context, new_tokens = result["context"], result["new_tokens"]
    summary = result["configs"]
    headers = [
        "cache",
        "B",
        "layers",
        "prefill tok/s",
        "decode tok/s",
        "decode ratio",
        "step-median ratio",
        "interleaved ratio",
        "recompute % of decode",
        "peak state",
        "hot / ckpt / scratch",
        "vs std equiv",
        "vs DynamicCache",
        "same tokens",
    ]
    rows = []
    for s in summary.values():
        mem = s["memory"]
        b = "-" if s["budget"] is None else f"{s['budget']} ({s['hot_window']})"
        cache = BASELINE if s["budget"] is None else f"kvdirect {s['form']}"
        if s["same_as"]:
            cache += f" (= {s['same_as']})"
        rows.append(
            [
                cache,
                b,
                s["forms"],
                harness.fmt(s["prefill_tokens_per_s"], 0),
                harness.fmt(s["decode_tokens_per_s"], 2),
                harness.fmt(s["decode_ratio"], 3),
                harness.fmt(s["step_median_ratio"], 3),
                harness.fmt(s["interleaved"]["paired_ratio"], 3) if s["interleaved"] else "-",
                f"{100 * s['recompute_share_of_decode']:.0f}%",
                harness.human_bytes(mem["state_bytes"]),
                " / ".join(
                    harness.human_bytes(mem[k])
                    for k in ("hot_kv_bytes", "checkpoint_bytes", "scratch_peak_bytes")
                ),
                f"{s['state_vs_standard_equivalent']:.2f}x",
                f"{s['state_vs_dynamic_cache']:.2f}x",
                "yes" if s["tokens_match_dynamic_cache"] else "NO",
            ]
        )
    print(
        f"\n### context {context} tokens, {new_tokens} decoded (greedy, no early stop): "
        f"{model}, CPU {threads} threads, median of {result['repeats']} interleaved repeats\n"
    )
    print(harness.markdown_table(headers, rows))
    std = next(iter(summary.values()))["memory"]["standard_equivalent_bytes"]
    print(
        f"\nstandard-cache equivalent at {context + new_tokens - 1} tokens: "
        f"{harness.human_bytes(std)}; DynamicCache K/V actually held: "
        f"{harness.human_bytes(next(iter(summary.values()))['dynamic_cache_kv_bytes'])}"
    )
    checks = []
    for form in FORMS:
        s = summary[f"B=all {form}"]
        lock = s["interleaved"]
        ok = s["decode_ratio"] >= B_ALL_TOLERANCE
        lock_ok = None if lock is None else lock["paired_ratio"] >= B_ALL_TOLERANCE
        checks.append(
            {
                "context": context,
                "form": form,
                "decode_ratio": s["decode_ratio"],
                "step_median_ratio": s["step_median_ratio"],
                "pass": ok,
                "interleaved_ratio": None if lock is None else lock["paired_ratio"],
                "interleaved_pass": lock_ok,
            }
        )
        line = (
            f"check B=all {form:8s} decode within 5% of DynamicCache at {context}: "
            f"{'PASS' if ok else 'FAIL'} (whole-run ratio {s['decode_ratio']:.3f})"
        )
        if s["same_as"]:
            line = f"{line} [same cache as {s['same_as']}]"
        if lock is not None:
            line += (
                f"; step-interleaved: {'PASS' if lock_ok else 'FAIL'} "
                f"(ratio {lock['paired_ratio']:.3f})"
            )
        print(line)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="context lengths (2048 8192)"
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="decoded tokens per config (default 32, 16 above 4096 context or with --quick)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved repeats (default 3, 2 above 4096 context or with --quick)",
    )
    parser.add_argument(
        "--interleaved-steps",
        type=int,
        default=None,
        help="step-interleaved decode rounds after the last repeat (default: --new-tokens; 0: off)",
    )
    parser.add_argument(
        "--all-configs",
        action="store_true",
        help="measure configurations that build the same cache separately (default: once)",
    )
    common.add_run_options(parser, "bench_cache", "contexts 512 and 1024, 16 tokens, 2 repeats")
    args = parser.parse_args(argv)

    contexts = args.contexts or ([512, 1024] if args.quick else [2048, 8192])
    if args.new_tokens is not None and args.new_tokens < 3:
        parser.error("--new-tokens must be at least 3")

    wall = harness.stopwatch()
    common.set_threads(args.threads)
    env = harness.environment(args.threads)
    harness.say(f"loading {args.model} ({args.dtype}) ...")
    loaded = common.load_model(args.model, args.dtype)

    harness.say("warming up ...")
    warm = seeded_ids(loaded, 96, args.seed + 1)
    run_config(loaded, warm, 4, None, None)
    for form in FORMS:
        run_config(loaded, warm, 4, "25%", form)

    results, checks = [], []
    for context in contexts:
        long = context > 4096 or args.quick
        new_tokens = args.new_tokens or (16 if long else 32)
        repeats = args.repeats or (2 if long else 3)
        elapsed = harness.stopwatch()
        lock_steps = new_tokens if args.interleaved_steps is None else args.interleaved_steps
        result = measure_context(
            loaded, context, new_tokens, repeats, args.seed, lock_steps, args.all_configs
        )
        result["wall_seconds"] = elapsed()
        results.append(result)

    wall_seconds = wall()
    print(
        f"\n## bench_cache: {loaded.name} {loaded.dtype}, CPU {args.threads} threads, "
        f"prefill chunk {CHUNK}, baseline {BASELINE} in the same run"
    )
    for result in results:
        checks += print_context(result, loaded.name, args.threads)
        print(f"context {result['context']}: wall time {result['wall_seconds']:.0f} s")
    print(
        "\ndecode ratio = DynamicCache decode time / this config's, paired per repeat (> 1: "
        "faster); step-median ratio: the same from each run's median decode step (less "
        "sensitive to bursts of CPU contention); interleaved ratio: after the last repeat every "
        "configuration decodes on, one step each in turn, median over rounds of the paired "
        "step-time ratio (the steadiest of the three). peak state = hot K/V + checkpoints + peak "
        "recompute scratch + token ids, from the session's memory snapshot; 'vs std equiv' "
        "divides it by the footprint's standard-cache equivalent, 'vs DynamicCache' by the "
        "K/V bytes the baseline actually held."
    )
    print(f"wall time {wall_seconds:.0f} s")

    fields = {
        "model": loaded.name,
        "dtype": loaded.dtype,
        "prefill_chunk": CHUNK,
        "baseline": BASELINE,
        "budgets": list(BUDGETS),
        "forms": list(FORMS),
        "prompt": f"seeded random token ids (seed {args.seed}, no special tokens)",
        "contexts": results,
        "checks": checks,
    }
    harness.save_run(args.out, "bench_cache", fields, env, wall_seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
