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
  ``n_cached`` tokens) fed with ``kvchat.chat.generate.prefill`` into a fresh
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
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

BASELINE = "re-prefill (DynamicCache)"
FOLLOW_UP = "Which bay holds the most lanterns? Answer in one short sentence."
QUESTION = "Which crate holds the most rope coils? Answer in one sentence."
GOODS = ("copper pipes", "lanterns", "maps", "barrels of oil", "rope coils", "glass lenses")


# -- the saved conversation -------------------------------------------------------------------
def notes(n: int, seed: int) -> str:
    """``n`` seeded one-line inventory notes: plain text with many small facts."""
    rng = random.Random(seed)
    lines = [
        f"Note {i}: crate {rng.randint(1, 999)} in bay {rng.randint(1, 40)} holds "
        f"{rng.randint(2, 500)} {rng.choice(GOODS)}, checked by {rng.choice(NAMES)}."
        for i in range(1, n + 1)
    ]
    return "Here are the warehouse notes.\n" + "\n".join(lines) + "\n" + QUESTION


NAMES = ("Ines", "Quill", "Marta", "Tobias", "Lena", "Oskar", "Priya", "Hugo")


def user_text(loaded: Any, target_tokens: int, seed: int) -> tuple[str, int]:
    """The longest ``notes`` text whose templated prompt has at most ``target_tokens``."""
    tok = loaded.tokenizer

    def prompt_tokens(n: int) -> int:
        messages = [{"role": "user", "content": notes(n, seed)}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    lo, hi = 1, 16
    while prompt_tokens(hi) <= target_tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # prompt_tokens(lo) <= target < prompt_tokens(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if prompt_tokens(mid) <= target_tokens else (lo, mid)
    return notes(lo, seed), prompt_tokens(lo)


def build(loaded: Any, root: Path, settings: Any, text: str, reply_tokens: int) -> dict[str, Any]:
    """Save a one-turn conversation under ``root``; what the timed runs need to know."""
    from kvchat.chat.conversation import open_session
    from kvchat.chat.settings import SamplingSettings

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
            "memory_after_build": result.memory,
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
    from kvchat.chat.conversation import open_session

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
        "state_bytes": memory["state_bytes"],
        "hot_tokens": memory["hot_tokens"],
        "disk_tier": memory["disk_tier"],
    }


def run_resume_first(
    loaded: Any, root: Path, settings: Any, conv: dict[str, Any]
) -> dict[str, Any]:
    from kvchat.chat.conversation import open_session
    from kvchat.chat.settings import SamplingSettings

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
        "recompute_share": result.memory["recompute_share"],
    }


def run_baseline(
    loaded: Any, history: list[int], follow_up: list[int], chunk: int
) -> dict[str, Any]:
    """(b) and (c) for the baseline: re-prefill the history, then the follow-up turn."""
    import torch
    from transformers import DynamicCache

    from kvchat.chat.generate import prefill
    from kvchat.models.quantize import inference_context

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
    from kvchat.kvdirect.planner import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=None, help="conversation tokens (4096)")
    parser.add_argument("--reply-tokens", type=int, default=16, help="reply length (16)")
    parser.add_argument("--max-mem", default=None, help="ceiling of the 2nd config (64MB)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (3)")
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--no-first-token", action="store_true", help="skip (c)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1024 tokens, 16MB, 2 repeats")
    parser.add_argument("--out", default="results/bench_resume.json")
    args = parser.parse_args(argv)

    context = args.context or (1024 if args.quick else 4096)
    repeats = args.repeats or (2 if args.quick else 3)
    max_mem_text = args.max_mem or ("16MB" if args.quick else "64MB")
    max_mem = parse_size(max_mem_text)
    chunk = args.prefill_chunk
    first_token = not args.no_first_token

    wall0 = time.perf_counter()
    common.set_threads(args.threads)
    env = common.environment(args.threads)
    common.say(f"loading {args.model} ({args.dtype}) ...")
    loaded = common.load_model(args.model, args.dtype)

    from kvchat.chat.settings import CacheSettings

    configs = {
        "default": CacheSettings(prefill_chunk=chunk),
        f"max-mem {max_mem_text}": CacheSettings(max_mem=max_mem, prefill_chunk=chunk),
    }
    text, prompt_tokens = user_text(loaded, context - args.reply_tokens, args.seed)

    with tempfile.TemporaryDirectory(prefix="kvchat-bench-resume-") as tmp:
        roots = {name: Path(tmp) / f"data-{i}" for i, name in enumerate(configs)}
        convs: dict[str, dict[str, Any]] = {}
        for name, settings in configs.items():
            common.say(f"building the {name} conversation ({prompt_tokens} prompt tokens) ...")
            common.collect()
            convs[name] = build(loaded, roots[name], settings, text, args.reply_tokens)
            common.say(
                f"  {convs[name]['n_cached']} tokens cached, "
                f"{common.human_bytes(convs[name]['segment_bytes'])} saved, "
                f"{convs[name]['build_seconds']:.1f} s"
            )
        names = list(configs)
        history = convs[names[0]]["history_ids"]
        for name in names[1:]:
            if convs[name]["history_ids"] != history:
                raise SystemExit(f"the {name} conversation holds other tokens than {names[0]}")

        common.say("warming up (one resume of each, a short re-prefill) ...")
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
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {item: [] for item in items}
        for rep in range(repeats):
            for kind, name in common.rotated(items, rep):
                common.collect()
                if kind == BASELINE:
                    r = run_baseline(loaded, history, follow_up or history[:4], chunk)
                elif kind == "resume":
                    r = run_resume(loaded, roots[name], configs[name], convs[name])
                else:
                    r = run_resume_first(loaded, roots[name], configs[name], convs[name])
                    r.pop("fed_ids")
                runs[(kind, name)].append(r)
                label = f"{kind} {name}".strip()
                common.say(f"  repeat {rep + 1}/{repeats} {label:34s} {r['seconds']:7.3f} s")

    base = runs[(BASELINE, "")]
    results: dict[str, Any] = {
        BASELINE: {
            "seconds": common.median([b["seconds"] for b in base]),
            "first_token_seconds": common.median([b["first_token_seconds"] for b in base]),
            "spread": common.spread([b["seconds"] for b in base]),
            "first_token_spread": common.spread([b["first_token_seconds"] for b in base]),
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
            "resume_seconds": common.median([r["seconds"] for r in rs]),
            "resume_spread": common.spread([r["seconds"] for r in rs]),
            "resume_ratio": common.median([b["seconds"] / r["seconds"] for b, r in zip(base, rs)]),
            "state_bytes_after_resume": rs[-1]["state_bytes"],
            "hot_tokens_after_resume": rs[-1]["hot_tokens"],
            "disk_tier": rs[-1]["disk_tier"],
            "per_repeat_resume": rs,
        }
        if first_token:
            fs = runs[("resume + first token", name)]
            entry |= {
                "first_token_seconds": common.median([f["seconds"] for f in fs]),
                "first_token_spread": common.spread([f["seconds"] for f in fs]),
                "first_token_ratio": common.median(
                    [b["first_token_seconds"] / f["seconds"] for b, f in zip(base, fs)]
                ),
                "same_first_token": all(f["token"] == b["token"] for b, f in zip(base, fs)),
                "per_repeat_first_token": fs,
            }
        results[name] = entry
    wall = time.perf_counter() - wall0

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
            common.human_bytes(results[BASELINE]["state_bytes"]),
            common.fmt(results[BASELINE]["seconds"], 3),
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
                common.human_bytes(e["segment_bytes"]),
                common.human_bytes(e["state_bytes_after_resume"]),
                common.fmt(e["resume_seconds"], 3),
                common.fmt(e["resume_ratio"], 1) + "x",
                f"{100 * e['resume_spread']:.0f}%",
            ]
        )
    print(common.markdown_table(headers, rows))
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
                common.fmt(results[BASELINE]["first_token_seconds"], 3),
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
                    common.fmt(e["first_token_seconds"], 3),
                    common.fmt(e["first_token_ratio"], 1) + "x",
                    f"{100 * e['first_token_spread']:.0f}%",
                    "yes" if e["same_first_token"] else "NO",
                ]
            )
        print(common.markdown_table(["how", "time s", "ratio", "spread", "same token"], rows))
    print(f"\nload average at start {env['loadavg_at_start']}; wall time {wall:.0f} s")

    data = {
        "benchmark": "bench_resume",
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
        "environment": env,
        "results": results,
        "wall_seconds": wall,
    }
    out = common.write_json(args.out, data)
    common.say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
