"""Fork: branching a 200-turn saved conversation, against copying it.

Setup (not timed): a conversation of ``--turns`` turns is saved through the store's own
``append_turn``, each turn shaped like a SmolLM2-135M turn under no ceiling: ``--tokens``
tokens of packed K/V per layer (30 layers, 3 K/V heads of 64, bfloat16, random values),
a user and an assistant message of ~300 characters, its token ids. No model is loaded: the
cost of a fork depends on the files, not on what the tensors mean.

Timed, interleaved, ``--repeats`` times each:

* ``fork``: ``ConversationStore.fork(id, turn=turns - 1)``, i.e. ``kvchat fork ID --turn
  199``, the branch an edit of the last message makes;
* ``copy``: the baseline: ``shutil.copytree`` of the conversation folder, what a store
  without shared segments would write to branch it.

Bytes written are counted by the kernel (``wchar`` of ``/proc/self/io``: every byte this
process passed to ``write``), independent of the store's accounting, and checked against
the fork folder's own bytes (files with one link: its journal and header).

Run from the repository root: ``python benchmarks/bench_fork.py [--quick]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402,F401  (this checkout's kvchat first on sys.path)

from kvchat.lab import harness  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M


def written_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def build(root: Path, turns: int, tokens: int, seed: int) -> str:
    import torch

    from kvchat.storage import ConversationStore

    g = torch.Generator().manual_seed(seed)
    conv = ConversationStore(root).create(
        model_name="smollm2-135m", fingerprint="sha256:" + "0" * 64, dtype="bfloat16", settings={}
    )
    width = 2 * KV_HEADS * HEAD_DIM
    for turn in range(1, turns + 1):
        tensors = {
            f"L{i}.kv": torch.randn(1, tokens, width, generator=g).to(torch.bfloat16)
            for i in range(LAYERS)
        }
        conv.append_turn(
            messages=[
                {"role": "user", "content": f"Question {turn}: " + "why is the sky blue? " * 14},
                {"role": "assistant", "content": f"Answer {turn}: " + "light scatters. " * 18},
            ],
            token_ids=list(range(turn * tokens, (turn + 1) * tokens)),
            tensors=tensors,
            extra={"n_cached": turn * tokens},
            engine_state={"rendered": "x" * (turn * 4), "n_cached": turn * tokens},
        )
    conv.close()
    return conv.id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=40, help="tokens per turn (40)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="50 turns, 3 repeats")
    parser.add_argument("--out", default="results/bench_fork.json")
    args = parser.parse_args(argv)
    turns = 50 if args.quick else args.turns
    repeats = 3 if args.quick else args.repeats
    wall = harness.stopwatch()
    env = harness.environment(threads=None)

    from kvchat.storage import ConversationStore
    from kvchat.storage.safe_fs import tree_usage

    with tempfile.TemporaryDirectory(prefix="kvchat-bench-fork-", dir="/var/tmp") as tmp:
        root = Path(tmp) / "data"
        harness.say(f"saving a {turns}-turn conversation ...")
        cid = build(root, turns, args.tokens, args.seed)
        store = ConversationStore(root)
        source = store.conversations_dir / cid
        size = tree_usage(source)[0]
        harness.say(f"  {harness.human_bytes(size)} on disk")

        def measure(kind: str, rep: int) -> dict[str, Any]:
            before = written_bytes()
            t0 = time.perf_counter()
            if kind == "fork":
                made = store.conversations_dir / store.fork(cid, turn=turns - 1)
            else:
                made = Path(tmp) / f"copy-{rep}"
                shutil.copytree(source, made)
            seconds = time.perf_counter() - t0
            wrote = written_bytes() - before
            total, shared = tree_usage(made)
            harness.say(
                f"  repeat {rep + 1} {kind:4s} {seconds * 1000:8.1f} ms, "
                f"{harness.human_bytes(wrote)} written"
            )
            return {"seconds": seconds, "written_bytes": wrote, "own_bytes": total - shared}

        runs = harness.interleaved(["copy", "fork"], repeats, measure, settle=None)

    fork, copy = runs["fork"], runs["copy"]
    summary = {
        "turns": turns,
        "conversation_bytes": size,
        "fork_seconds": harness.median([r["seconds"] for r in fork]),
        "copy_seconds": harness.median([r["seconds"] for r in copy]),
        "fork_written_bytes": max(r["written_bytes"] for r in fork),
        "fork_own_bytes": max(r["own_bytes"] for r in fork),
        "copy_written_bytes": max(r["written_bytes"] for r in copy),
        "ratio": harness.median_ratio(copy, fork, "seconds"),
    }
    print(
        f"\n## bench_fork: a {turns}-turn conversation ({harness.human_bytes(size)}), "
        f"median of {repeats}\n"
    )
    print(harness.markdown_table(
        ["how", "time ms", "written", "ratio"],
        [
            ["copy (baseline)", harness.fmt(summary["copy_seconds"] * 1000, 1),
             harness.human_bytes(summary["copy_written_bytes"]), "1.00"],
            [f"kvchat fork --turn {turns - 1}", harness.fmt(summary["fork_seconds"] * 1000, 1),
             harness.human_bytes(summary["fork_written_bytes"]), harness.fmt(summary["ratio"], 1)],
        ],
    ))  # fmt: skip
    targets = summary["fork_seconds"] < 0.2 and summary["fork_written_bytes"] < 10**6
    print(f"\ntargets (< 0.2 s, < 1 MB written): {'met' if targets else 'NOT met'}")
    harness.save_run(
        args.out, "bench_fork", {"args": vars(args), "summary": summary, "runs": runs}, env, wall()
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
