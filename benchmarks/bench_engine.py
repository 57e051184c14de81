"""Engine speed: kvchat's prefill + decode loop against ``model.generate`` with DynamicCache.

Same model, dtype, thread count, prompt and greedy decode, in the same process. For each
configuration one run is: prefill ``--context`` tokens (time to first token), then decode
``--new-tokens`` greedy tokens with no early stop (time per decoded token = decode time over
the ``new_tokens - 1`` decode forward calls; the first token comes from the prefill logits).

Configurations:

* ``hf generate``: ``model.generate(cache=DynamicCache(config=...), do_sample=False,
  min_new_tokens=max_new_tokens=N)``, the whole prompt in one forward call (what generate
  does). The baseline. Prefill/decode split from a timestamping logits processor: it runs
  once per generated token, right after the forward call that produced its logits.
* ``kvchat chunk=256`` / ``kvchat chunk=1024``: ``kvchat.engine.chat.generate.generate`` on the
  cache a default ``ChatSession`` builds (``CacheSettings()``: no ``--max-mem``, so a
  ``KVDirectCache`` whose layers are all in ``kv`` form), ``stop_ids=set()``.
* ``kvchat loop + DynamicCache``: kvchat's ``generate`` loop over a plain ``DynamicCache``
  (chunk 256). Not a target; it separates what the loop costs from what the cache costs.

Whole runs are repeated ``--repeats`` times, interleaved (order rotating per repeat), and
each ratio is paired with the baseline run of the same repeat. Then a lockstep phase decodes
once more with ``model.generate`` while, inside its logits processor, kvchat's caches take
one decode step each: per-step ratios of neighbouring steps, the measure least disturbed by
other jobs on the machine (see ``run_lockstep``). The decode target (ratio >= 0.95) is
checked on both.

Run from the repository root: ``python benchmarks/bench_engine.py [--quick]``.
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
from kvchat.lab.prompts import seeded_ids  # noqa: E402

DECODE_TARGET = 0.95
BASELINE = "hf generate"


# -- one measured run per configuration ------------------------------------------------------
def run_hf_generate(loaded: Any, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    import torch
    from transformers import DynamicCache, LogitsProcessorList

    model = loaded.model
    cache = DynamicCache(config=model.config)
    stamps: list[float] = []
    input_ids = torch.tensor([prompt], dtype=torch.long, device=loaded.device)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        cache=cache,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        logits_processor=LogitsProcessorList([common.stamping_processor(stamps)]),
        pad_token_id=loaded.tokenizer.eos_token_id,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    end = time.perf_counter()
    tokens = out[0, len(prompt) :].tolist()
    # generate must have used (and filled) the DynamicCache it was given
    assert type(cache) is DynamicCache, type(cache)
    assert cache.get_seq_length() == len(prompt) + new_tokens - 1, cache.get_seq_length()
    assert len(stamps) == new_tokens and len(tokens) == new_tokens
    return {
        "prefill_seconds": stamps[0] - t0,
        "decode_seconds": stamps[-1] - stamps[0],
        "total_seconds": end - t0,
        "step_seconds": harness.intervals(stamps),
        "tokens": tokens,
    }


def run_kvchat(
    loaded: Any, prompt: list[int], new_tokens: int, chunk: int, standard: bool = False
) -> dict[str, Any]:
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.chat.settings import CacheSettings

    settings = CacheSettings(prefill_chunk=chunk, kind="standard" if standard else "kvdirect")
    session = ChatSession(loaded, cache=settings)
    cache = session.cache
    if not standard:
        forms = {layer.form for layer in cache.layers}
        assert forms == {"kv"}, f"default session cache is not all-kv: {forms}"
    try:
        t0 = time.perf_counter()
        outcome, steps = common.stamped_generate(loaded, session, prompt, new_tokens, chunk)
        end = time.perf_counter()
    finally:
        session.close()
    return {
        "prefill_seconds": outcome.prefill_seconds,
        "decode_seconds": outcome.decode_seconds,
        "total_seconds": end - t0,
        "step_seconds": steps,
        "tokens": outcome.tokens,
        "cache_type": type(cache).__name__,
    }


def run_lockstep(loaded: Any, prompt: list[int], new_tokens: int, chunk: int) -> dict[str, Any]:
    """``model.generate`` and kvchat's decode steps run alternately, one step each.

    kvchat's caches (the default session's, and a DynamicCache for reference) are prefilled
    first; then ``model.generate`` runs, and a logits processor (called once per generated
    token) performs one kvchat decode step on each of them, timed alone, before handing back
    to generate. generate's own step time is the time from the processor's return to its
    next call. Neighbouring steps see the same machine load, so the per-step ratios do not
    drift with other jobs the way whole-run ratios do.
    """
    import torch
    from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

    from kvchat.engine.chat.generate import prefill
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.chat.settings import CacheSettings

    names = {"kvchat": CacheSettings(prefill_chunk=chunk)}
    names["kvchat loop + DynamicCache"] = CacheSettings(kind="standard", prefill_chunk=chunk)
    sessions = {name: ChatSession(loaded, cache=cs) for name, cs in names.items()}
    nxt: dict[str, int] = {}
    with torch.inference_mode():
        for name, session in sessions.items():
            logits = prefill(loaded.model, session.cache, prompt, loaded.device, chunk)
            nxt[name] = int(torch.argmax(logits).item())
            session.close()

    times: dict[str, list[float]] = {BASELINE: [], **{name: [] for name in sessions}}
    tokens: dict[str, list[int]] = {name: [nxt[name]] for name in sessions}

    class Lockstep(LogitsProcessor):
        def __init__(self) -> None:
            self.calls = 0
            self.left_at: float | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            entered = time.perf_counter()
            if self.left_at is not None:
                times[BASELINE].append(entered - self.left_at)
            if self.calls < new_tokens - 1:  # generate decodes new_tokens - 1 steps too
                with torch.inference_mode():
                    for name in harness.rotated(list(sessions), self.calls):
                        nxt[name], seconds = common.attached_step(loaded, sessions[name], nxt[name])
                        times[name].append(seconds)
                        tokens[name].append(nxt[name])
            self.calls += 1
            self.left_at = time.perf_counter()
            return scores

    input_ids = torch.tensor([prompt], dtype=torch.long, device=loaded.device)
    out = loaded.model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        cache=DynamicCache(config=loaded.model.config),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        logits_processor=LogitsProcessorList([Lockstep()]),
        pad_token_id=loaded.tokenizer.eos_token_id,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    hf_tokens = out[0, len(prompt) :].tolist()
    result: dict[str, Any] = {"steps": len(times[BASELINE]), "configs": {}}
    for name in times:
        ratio = harness.median_ratio(times[BASELINE], times[name])
        result["configs"][name] = {
            "step_median_ms": 1000 * harness.median(times[name]),
            "decode_tokens_per_s": 1 / harness.median(times[name]),
            "paired_ratio_vs_generate": ratio,
            "tokens_match_generate": name == BASELINE or tokens[name] == hf_tokens,
        }
    return result


def configurations(context: int) -> list[tuple[str, Any]]:
    configs: list[tuple[str, Any]] = [
        (BASELINE, lambda L, p, n: run_hf_generate(L, p, n)),
        ("kvchat chunk=256", lambda L, p, n: run_kvchat(L, p, n, 256)),
    ]
    if context > 256:
        configs.append((f"kvchat chunk={context}", lambda L, p, n: run_kvchat(L, p, n, context)))
    configs.append(
        ("kvchat loop + DynamicCache", lambda L, p, n: run_kvchat(L, p, n, 256, standard=True))
    )
    return configs


# -- the benchmark ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (1024)")
    parser.add_argument("--new-tokens", type=int, default=None, help="decoded tokens (64)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (5)")
    common.add_run_options(parser, "bench_engine", "256 context, 16 tokens, 3 repeats")
    args = parser.parse_args(argv)

    context = args.context or (256 if args.quick else 1024)
    new_tokens = args.new_tokens or (16 if args.quick else 64)
    repeats = args.repeats or (3 if args.quick else 5)
    if new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (one prefill token + decode)")

    wall = harness.stopwatch()
    common.set_threads(args.threads)
    env = harness.environment(args.threads)
    harness.say(f"loading {args.model} ({args.dtype}) ...")
    loaded = common.load_model(args.model, args.dtype)
    prompt = seeded_ids(loaded, context, args.seed)
    configs = dict(configurations(context))
    names = list(configs)

    harness.say("warming up ...")
    warm = seeded_ids(loaded, min(64, context), args.seed + 1)
    for fn in configs.values():
        fn(loaded, warm, 4)

    def measure(name: str, rep: int) -> dict[str, Any]:
        result = configs[name](loaded, prompt, new_tokens)
        harness.say(
            f"  repeat {rep + 1}/{repeats} {name:28s} prefill {result['prefill_seconds']:6.2f}s"
            f"  decode {(new_tokens - 1) / result['decode_seconds']:6.2f} tok/s"
        )
        return result

    runs = harness.interleaved(names, repeats, measure)

    steps = new_tokens - 1
    summary: dict[str, dict[str, Any]] = {}
    base_runs = runs[BASELINE]
    for name in names:
        rs = runs[name]
        prefill_tps = [context / r["prefill_seconds"] for r in rs]
        decode_tps = [steps / r["decode_seconds"] for r in rs]
        # paired with the baseline run of the same repeat (measured next to it)
        prefill_ratio = harness.paired_ratios(base_runs, rs, "prefill_seconds")
        decode_ratio = harness.paired_ratios(base_runs, rs, "decode_seconds")
        # the same ratio from each run's median step time: robust to bursts of CPU contention
        step_median = [harness.median(r["step_seconds"]) for r in rs]
        step_ratio = harness.paired_ratios(
            [harness.median(b["step_seconds"]) for b in base_runs], step_median
        )
        summary[name] = {
            "prefill_tokens_per_s": harness.median(prefill_tps),
            "ttft_seconds": harness.median([r["prefill_seconds"] for r in rs]),
            "decode_tokens_per_s": harness.median(decode_tps),
            "ms_per_decoded_token": 1000 / harness.median(decode_tps),
            "prefill_ratio": harness.median(prefill_ratio),
            "decode_ratio": harness.median(decode_ratio),
            "step_median_tokens_per_s": 1 / harness.median(step_median),
            "step_median_ratio": harness.median(step_ratio),
            "decode_spread": harness.spread(decode_tps),
            "prefill_spread": harness.spread(prefill_tps),
            "tokens_match_baseline": all(r["tokens"] == b["tokens"] for r, b in zip(rs, base_runs)),
            "per_repeat": [
                {k: v for k, v in r.items() if k not in ("tokens", "step_seconds")}
                | {
                    "prefill_ratio": pr,
                    "decode_ratio": dr,
                    "step_median_seconds": sm,
                    "step_median_ratio": sr,
                }
                for r, pr, dr, sm, sr in zip(
                    rs, prefill_ratio, decode_ratio, step_median, step_ratio
                )
            ],
        }
    harness.say("lockstep decode (one step each in turn) ...")
    lockstep = run_lockstep(loaded, prompt, new_tokens, 256)
    wall_seconds = wall()

    headers = [
        "engine",
        "prefill tok/s",
        "TTFT s",
        "prefill ratio",
        "decode tok/s",
        "ms/token",
        "decode ratio",
        "step-median ratio",
        "decode spread",
        "same tokens",
    ]
    rows = []
    for name in names:
        s = summary[name]
        rows.append(
            [
                name,
                harness.fmt(s["prefill_tokens_per_s"], 0),
                harness.fmt(s["ttft_seconds"], 2),
                harness.fmt(s["prefill_ratio"], 3),
                harness.fmt(s["decode_tokens_per_s"], 2),
                harness.fmt(s["ms_per_decoded_token"], 1),
                harness.fmt(s["decode_ratio"], 3),
                harness.fmt(s["step_median_ratio"], 3),
                f"{100 * s['decode_spread']:.0f}%",
                "yes" if s["tokens_match_baseline"] else "NO",
            ]
        )
    print(
        f"\n## bench_engine: {loaded.name} {loaded.dtype}, CPU {args.threads} threads, "
        f"context {context}, {new_tokens} new tokens (greedy, no early stop), "
        f"median of {repeats} interleaved repeats\n"
    )
    print(harness.markdown_table(headers, rows))
    print(
        "\nratio = baseline time / engine time, paired per repeat (> 1: faster than "
        f"`{BASELINE}`); step-median ratio: the same from each run's median decode step "
        "(less sensitive to bursts of CPU contention); spread = (max - min) / median of the "
        "repeats' decode tok/s."
    )
    print(
        f"\nlockstep decode: {lockstep['steps']} steps, each kvchat decode step run right after "
        f"one `{BASELINE}` step (inside its logits processor), ratios paired per step:\n"
    )
    lock_rows = [
        [
            name,
            harness.fmt(c["decode_tokens_per_s"], 2),
            harness.fmt(c["step_median_ms"], 1),
            harness.fmt(c["paired_ratio_vs_generate"], 3),
            "yes" if c["tokens_match_generate"] else "NO",
        ]
        for name, c in lockstep["configs"].items()
    ]
    print(
        harness.markdown_table(
            ["decode step", "tok/s (median step)", "ms/step", "ratio vs generate", "same tokens"],
            lock_rows,
        )
    )
    print()
    checks = {}
    for name in names:
        if name.startswith("kvchat chunk="):
            ratio = summary[name]["decode_ratio"]
            ok = ratio >= DECODE_TARGET
            checks[name] = {"decode_ratio": ratio, "target": DECODE_TARGET, "pass": ok}
            print(
                f"decode ratio check ({name} vs {BASELINE}, target >= {DECODE_TARGET}): "
                f"{'PASS' if ok else 'FAIL'} ({ratio:.3f})"
            )
    lock_ratio = lockstep["configs"]["kvchat"]["paired_ratio_vs_generate"]
    lock_ok = lock_ratio >= DECODE_TARGET
    checks["lockstep kvchat"] = {
        "decode_ratio": lock_ratio,
        "target": DECODE_TARGET,
        "pass": lock_ok,
    }
    print(
        f"decode ratio check (lockstep kvchat step vs {BASELINE} step, target >= "
        f"{DECODE_TARGET}): {'PASS' if lock_ok else 'FAIL'} ({lock_ratio:.3f})"
    )
    print(f"wall time {wall_seconds:.0f} s")

    fields = {
        "model": loaded.name,
        "dtype": loaded.dtype,
        "context": context,
        "new_tokens": new_tokens,
        "decode_steps_timed": steps,
        "repeats": repeats,
        "prompt": f"{context} seeded random token ids (seed {args.seed}, no special tokens)",
        "baseline": BASELINE,
        "results": summary,
        "lockstep": lockstep,
        "checks": checks,
    }
    harness.save_run(args.out, "bench_engine", fields, env, wall_seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
