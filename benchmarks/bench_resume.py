"""Resume: reopening a saved ~4K-token conversation against re-prefilling its history.

A chat app that saves only text must, to continue a conversation, run the whole history
through the model again. kvchat saves each turn's cache state (K/V or residual checkpoints,
per layer) and rebuilds the cache from those files instead. This script measures both, in
one process, interleaved, as a ratio.

Setup (not timed): one conversation per cache configuration is built and saved through
kvchat's own ``open_session`` into a temporary data dir: one long user message (seeded,
generated notes ending in a question, sized so that the conversation holds ``--context``
tokens) and a short greedy reply (``--reply-tokens``). Configurations:

* ``default``: ``CacheSettings()`` (what ``kvchat run`` does with no cache options): no
  ceiling, so every layer keeps K/V and the segment holds K/V; resume reads them back.
* ``max-mem <X>``: ``CacheSettings(max_mem=X)`` (``kvchat run --max-mem X``): residual
  checkpoints at every layer, more than the ceiling holds, so the disk tier is in use; resume
  points the checkpoints at the segment file and recomputes the hot window's K/V from them.

Timed, once per configuration and repeat, in an order rotating from repeat to repeat:

* (a) ``resume``: ``open_session(..., conversation_id=ID)`` until it returns, i.e. the
  session is ready for its next turn (lock, manifest, segment checksums, cache rebuilt).
  The per-process checksum memo is cleared first, so each resume verifies its segments as
  a freshly started process would. The OS page cache is warm (the files were just written
  or read), as it is when a conversation is resumed soon after it was saved.
* (b) ``re-prefill``: the baseline. The same token ids (the conversation's whole history:
  ``n_cached`` tokens) fed with ``kvchat.engine.chat.generate.prefill`` into a fresh
  transformers ``DynamicCache``, in chunks of ``--prefill-chunk`` (the engine's default,
  256), under the engine's inference context. Tokenising the text (a few ms) is not counted.
* (c) ``resume + first token``: (a), then ``session.send(FOLLOW_UP, max_new_tokens=1)`` with
  saving switched off for that call (a first token is shown before a turn is saved),
  against the baseline's continuation: the follow-up's token ids prefilled into the same
  ``DynamicCache`` right after (b), then the argmax. Time to the first reply token of the
  next turn, either way. The first tokens must be equal (KV-Direct is exact).

Per repeat, ratio = baseline time / resume time (> 1: resuming is faster), paired with the
baseline measured in the same repeat; the median over repeats is reported, with the median
raw times beside it.

Run from the repository root: ``python benchmarks/bench_resume.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch is imported)
from common import user_text  # noqa: E402

from kvchat.lab import harness  # noqa: E402

BASELINE = "re-prefill (DynamicCache)"
FOLLOW_UP = "Which bay holds the most lanterns? Answer in one short sentence."


# -- the saved conversation -------------------------------------------------------------------
def build(loaded: Any, root: Path, settings: Any, text: str, reply_tokens: int) -> dict[str, Any]:
    """Save a one-turn conversation under ``root``; what the timed runs need to know."""
    from kvchat.engine.chat.conversation import open_session
    from kvchat.engine.chat.settings import SamplingSettings

    t0 = time.perf_counter()
    session = open_session(loaded, data_dir=root, cache=settings)
    try:
        result = session.send(text, SamplingSettings(max_new_tokens=reply_tokens))
        if result.error:
            raise SystemExit(f"building the conversation failed: {result.error}")
        n_cached = session.cache.get_seq_length()
        conversation = session.conversation
        info = {
            "conversation_id": conversation.id,
            "path": conversation.path,
            "n_cached": n_cached,
            "history_ids": list(session.token_ids[:n_cached]),
            "reply_tokens": len(result.tokens),
            "prompt_tokens": result.prompt_tokens,
            "segment_bytes": sum(t.segment.nbytes for t in conversation.manifest.turns),
            "forms": sorted(set(session.forms or [])),
            "memory_after_build": result.memory.to_dict(),
            "build_seconds": time.perf_counter() - t0,
        }
    finally:
        session.close()
    return info


# -- the timed runs ---------------------------------------------------------------------------
def forget_checksums(path: Path) -> None:
    """Make the next open verify every segment, as a new process would."""
    from kvchat.storage import segments

    segments.forget(path)


def run_resume(loaded: Any, root: Path, settings: Any, conv: dict[str, Any]) -> dict[str, Any]:
    from kvchat.engine.chat.conversation import open_session

    forget_checksums(conv["path"])
    t0 = time.perf_counter()
    session = open_session(
        loaded, data_dir=root, cache=settings, conversation_id=conv["conversation_id"]
    )
    seconds = time.perf_counter() - t0
    try:
        assert session.cache.get_seq_length() == conv["n_cached"]
        memory = session.memory()
    finally:
        session.close()
    return {
        "seconds": seconds,
        "state_bytes": memory.state_bytes,
        "hot_tokens": memory.hot_tokens,
        "disk_tier": memory.disk_tier,
    }


def run_resume_first(
    loaded: Any, root: Path, settings: Any, conv: dict[str, Any]
) -> dict[str, Any]:
    from kvchat.engine.chat.conversation import open_session
    from kvchat.engine.chat.settings import SamplingSettings

    forget_checksums(conv["path"])
    t0 = time.perf_counter()
    session = open_session(
        loaded, data_dir=root, cache=settings, conversation_id=conv["conversation_id"]
    )
    resumed = time.perf_counter()
    conversation, session.conversation = session.conversation, None  # no save of this turn
    try:
        result = session.send(FOLLOW_UP, SamplingSettings(max_new_tokens=1))
        seconds = time.perf_counter() - t0
        fed = list(session.token_ids[:-1])  # everything the cache was fed, in order
    finally:
        session.conversation = conversation
        session.close()
    return {
        "seconds": seconds,
        "resume_seconds": resumed - t0,
        "token": result.tokens[0],
        "fed_ids": fed,
        "recompute_share": result.memory.recompute_share,
    }


def run_baseline(
    loaded: Any, history: list[int], follow_up: list[int], chunk: int
) -> dict[str, Any]:
    """(b) and (c) for the baseline: re-prefill the history, then the follow-up turn."""
    import torch
    from transformers import DynamicCache

    from kvchat.engine.chat.generate import prefill
    from kvchat.engine.models.quantize import inference_context

    cache = DynamicCache(config=loaded.model.config)
    with inference_context(loaded.model):
        t0 = time.perf_counter()
        prefill(loaded.model, cache, history, loaded.device, chunk)
        t_history = time.perf_counter() - t0
        logits = prefill(loaded.model, cache, follow_up, loaded.device, chunk)
        token = int(torch.argmax(logits).item())
        t_first = time.perf_counter() - t0
    assert cache.get_seq_length() == len(history) + len(follow_up)
    kv_bytes = sum(
        layer.keys.numel() * layer.keys.element_size() * 2
        for layer in cache.layers
        if layer.keys is not None
    )
    # the cache as it stood after the history alone: what a resume must rebuild
    history_bytes = kv_bytes * len(history) // cache.get_seq_length()
    return {
        "seconds": t_history,
        "first_token_seconds": t_first,
        "token": token,
        "state_bytes": history_bytes,
    }


# -- the benchmark ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    from kvchat.units import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=None, help="conversation tokens (4096)")
    parser.add_argument("--reply-tokens", type=int, default=16, help="reply length (16)")
    parser.add_argument("--max-mem", default=None, help="ceiling of the 2nd config (64MB)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (3)")
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--no-first-token", action="store_true", help="skip (c)")
    common.add_run_options(parser, "bench_resume", "1024 tokens, 16MB, 2 repeats")
    args = parser.parse_args(argv)

    context = args.context or (1024 if args.quick else 4096)
    repeats = args.repeats or (2 if args.quick else 3)
    max_mem_text = args.max_mem or ("16MB" if args.quick else "64MB")
    max_mem = parse_size(max_mem_text)
    chunk = args.prefill_chunk
    first_token = not args.no_first_token

    wall = harness.stopwatch()
    common.set_threads(args.threads)
    env = harness.environment(args.threads)
    harness.say(f"loading {args.model} ({args.dtype}) ...")
    loaded = common.load_model(args.model, args.dtype)

    from kvchat.engine.chat.settings import CacheSettings

    configs = {
        "default": CacheSettings(prefill_chunk=chunk),
        f"max-mem {max_mem_text}": CacheSettings(max_mem=max_mem, prefill_chunk=chunk),
    }
    text, prompt_tokens = user_text(loaded, context - args.reply_tokens, args.seed)

    with tempfile.TemporaryDirectory(prefix="kvchat-bench-resume-") as tmp:
        roots = {name: Path(tmp) / f"data-{i}" for i, name in enumerate(configs)}
        convs: dict[str, dict[str, Any]] = {}
        for name, settings in configs.items():
            harness.say(f"building the {name} conversation ({prompt_tokens} prompt tokens) ...")
            harness.collect()
            convs[name] = build(loaded, roots[name], settings, text, args.reply_tokens)
            harness.say(
                f"  {convs[name]['n_cached']} tokens cached, "
                f"{harness.human_bytes(convs[name]['segment_bytes'])} saved, "
                f"{convs[name]['build_seconds']:.1f} s"
            )
        names = list(configs)
        history = convs[names[0]]["history_ids"]
        for name in names[1:]:
            if convs[name]["history_ids"] != history:
                raise SystemExit(f"the {name} conversation holds other tokens than {names[0]}")

        harness.say("warming up (one resume of each, a short re-prefill) ...")
        follow_up: list[int] = []
        for name in names:
            run_resume(loaded, roots[name], configs[name], convs[name])
            if first_token:
                warm = run_resume_first(loaded, roots[name], configs[name], convs[name])
                follow_up = warm["fed_ids"][len(history) :]
                assert warm["fed_ids"][: len(history)] == history
        run_baseline(loaded, history[:64], follow_up or history[:4], chunk)

        items: list[tuple[str, str]] = [(BASELINE, "")]
        for name in names:
            items.append(("resume", name))
            if first_token:
                items.append(("resume + first token", name))

        def measure(item: tuple[str, str], rep: int) -> dict[str, Any]:
            kind, name = item
            if kind == BASELINE:
                r = run_baseline(loaded, history, follow_up or history[:4], chunk)
            elif kind == "resume":
                r = run_resume(loaded, roots[name], configs[name], convs[name])
            else:
                r = run_resume_first(loaded, roots[name], configs[name], convs[name])
                r.pop("fed_ids")
            label = f"{kind} {name}".strip()
            harness.say(f"  repeat {rep + 1}/{repeats} {label:34s} {r['seconds']:7.3f} s")
            return r

        runs = harness.interleaved(items, repeats, measure)

    base = runs[(BASELINE, "")]
    results: dict[str, Any] = {
        BASELINE: {
            "seconds": harness.median([b["seconds"] for b in base]),
            "first_token_seconds": harness.median([b["first_token_seconds"] for b in base]),
            "spread": harness.spread([b["seconds"] for b in base]),
            "first_token_spread": harness.spread([b["first_token_seconds"] for b in base]),
            "state_bytes": base[-1]["state_bytes"],
            "per_repeat": base,
        }
    }
    for name in names:
        rs = runs[("resume", name)]
        entry: dict[str, Any] = {
            "settings": configs[name].as_dict(),
            "forms": convs[name]["forms"],
            "segment_bytes": convs[name]["segment_bytes"],
            "build_seconds": convs[name]["build_seconds"],
            "resume_seconds": harness.median([r["seconds"] for r in rs]),
            "resume_spread": harness.spread([r["seconds"] for r in rs]),
            "resume_ratio": harness.median_ratio(base, rs, "seconds"),
            "state_bytes_after_resume": rs[-1]["state_bytes"],
            "hot_tokens_after_resume": rs[-1]["hot_tokens"],
            "disk_tier": rs[-1]["disk_tier"],
            "per_repeat_resume": rs,
        }
        if first_token:
            fs = runs[("resume + first token", name)]
            entry |= {
                "first_token_seconds": harness.median([f["seconds"] for f in fs]),
                "first_token_spread": harness.spread([f["seconds"] for f in fs]),
                "first_token_ratio": harness.median_ratio(
                    [b["first_token_seconds"] for b in base], [f["seconds"] for f in fs]
                ),
                "same_first_token": all(f["token"] == b["token"] for b, f in zip(base, fs)),
                "per_repeat_first_token": fs,
            }
        results[name] = entry
    wall_seconds = wall()

    n_cached = len(history)
    print(
        f"\n## bench_resume: {loaded.name} {loaded.dtype}, CPU {args.threads} threads, "
        f"a saved conversation of {n_cached} tokens ({prompt_tokens}-token user message + "
        f"{convs[names[0]]['reply_tokens']}-token reply), prefill chunk {chunk}, median of "
        f"{repeats} interleaved repeats\n"
    )
    headers = ["how", "cold form", "on disk", "resident after", "time s", "ratio", "spread"]
    rows = [
        [
            BASELINE,
            "-",
            "-",
            harness.human_bytes(results[BASELINE]["state_bytes"]),
            harness.fmt(results[BASELINE]["seconds"], 3),
            "1.00",
            f"{100 * results[BASELINE]['spread']:.0f}%",
        ]
    ]
    for name in names:
        e = results[name]
        rows.append(
            [
                f"resume {name}" + (" (disk tier)" if e["disk_tier"] else ""),
                "/".join(e["forms"]),
                harness.human_bytes(e["segment_bytes"]),
                harness.human_bytes(e["state_bytes_after_resume"]),
                harness.fmt(e["resume_seconds"], 3),
                harness.fmt(e["resume_ratio"], 1) + "x",
                f"{100 * e['resume_spread']:.0f}%",
            ]
        )
    print(harness.markdown_table(headers, rows))
    print(
        "\nratio = re-prefill time / resume time, paired per repeat (> 1: resuming is faster); "
        "resume = open_session(conversation_id=...) until ready for the next turn, segment "
        "checksums included (page cache warm); spread = (max - min) / median."
    )
    if first_token:
        print(
            f"\nTime to the first reply token of the next turn ({len(follow_up)} new tokens: "
            f"the follow-up message in the chat template):\n"
        )
        rows = [
            [
                f"{BASELINE} + follow-up",
                harness.fmt(results[BASELINE]["first_token_seconds"], 3),
                "1.00",
                f"{100 * results[BASELINE]['first_token_spread']:.0f}%",
                "-",
            ]
        ]
        for name in names:
            e = results[name]
            rows.append(
                [
                    f"resume {name} + follow-up",
                    harness.fmt(e["first_token_seconds"], 3),
                    harness.fmt(e["first_token_ratio"], 1) + "x",
                    f"{100 * e['first_token_spread']:.0f}%",
                    "yes" if e["same_first_token"] else "NO",
                ]
            )
        print(harness.markdown_table(["how", "time s", "ratio", "spread", "same token"], rows))
    print(f"\nload average at start {env['loadavg_at_start']}; wall time {wall_seconds:.0f} s")

    fields = {
        "model": loaded.name,
        "dtype": loaded.dtype,
        "context": context,
        "n_cached": n_cached,
        "prompt_tokens": prompt_tokens,
        "reply_tokens": convs[names[0]]["reply_tokens"],
        "follow_up_tokens": len(follow_up),
        "prefill_chunk": chunk,
        "repeats": repeats,
        "prompt": f"seeded inventory notes (seed {args.seed}) + a question, chat template",
        "baseline": BASELINE,
        "results": results,
    }
    harness.save_run(args.out, "bench_resume", fields, env, wall_seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
