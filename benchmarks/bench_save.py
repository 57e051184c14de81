"""What saving a turn costs early and late in a conversation: turn 2 against turn 200.

A conversation is built in a temporary folder with ``--turns`` turns all of the same size
(same message lengths, same number of token ids, the same per-turn ``extra`` and
``engine_state`` shape, one small fixed tensor). Two snapshots of it are kept: after turn 1
and after turn ``N - 1``. Each repeat gets its own copy of each (all made, and fsynced, before
anything is measured); it opens them and times the save of the next turn (turn 2, turn N),
in an order that rotates from repeat to repeat.

What is timed is the *manifest part* of a save: ``append_turn`` minus the time spent
encoding and writing the segment (``append_turn`` returns that time). It includes checking
the arguments, building the in-memory manifest, writing the journal record or rewriting
the manifest, and their fsyncs. Beside it: the bytes written to files other than the
segment (journal growth, plus the whole ``manifest.json`` when a save replaces it).

Target: turn N costs at most 1.2x turn 2 (median over repeats of the per-repeat ratio).
Only the store's public API is used.

Run from the repository root: ``python benchmarks/bench_save.py [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402, F401  (puts this checkout first on sys.path, sets OMP_WAIT_POLICY)

from kvchat.lab import harness  # noqa: E402

TARGET = 1.2


def turn_args(i: int, args: argparse.Namespace, rendered: list[str]) -> dict[str, Any]:
    """Turn ``i``: every turn the same size (ids, counts and padding keep a fixed width)."""
    import torch

    user = f"question {i:04d} ".ljust(args.chars // 2, "q")
    reply = f"answer {i:04d} ".ljust(args.chars - len(user), "a")
    state = {
        "n_cached": 100_000 + i * args.tokens,
        "ids_from": 0,
        "cache": {"max_mem": None, "hot_window": 128, "checkpoint": "residual"},
    }
    if args.rendered:  # what the engine hands over: the whole conversation as text
        rendered.append(f"<user>{user}<assistant>{reply}")
        state["rendered"] = "".join(rendered)
    return dict(
        messages=[{"role": "user", "content": user}, {"role": "assistant", "content": reply}],
        token_ids=[10_000 + (i % 1000)] * args.tokens,
        tensors={"h": torch.zeros(4, 16)},
        extra={
            "n_cached": 100_000 + i * args.tokens,
            "memory": {"weights": 270_000_000, "kv_hot": 1_048_576, "kv_cold": 524_288},
            "rebase": False,
        },
        engine_state=state,
    )


def build(root: Path, args: argparse.Namespace) -> tuple[str, Path, Path, list[dict]]:
    """The conversation after turn 1 and after turn N - 1 (folder copies), and the arguments
    of turn 2 and turn N."""
    from kvchat.storage import ConversationStore

    store = ConversationStore(root / "build")
    fingerprint = "sha256:" + "0" * 64
    conv = store.create(
        model_name="bench", fingerprint=fingerprint, dtype="float32", settings={"system": "Hi."}
    )
    rendered: list[str] = []
    all_args = [turn_args(i, args, rendered) for i in range(1, args.turns + 1)]
    conv.append_turn(**all_args[0])
    conv.close()
    early = root / "after-1"
    shutil.copytree(conv.path, early)
    with store.open(conv.id) as again:
        for i in range(2, args.turns):
            again.append_turn(**all_args[i - 1])
    late = root / f"after-{args.turns - 1}"
    shutil.copytree(conv.path, late)
    return conv.id, early, late, [all_args[1], all_args[-1]]


def files_beside_segments(folder: Path) -> dict[str, tuple[int, int]]:
    """(inode, size) of each file of the conversation folder but the segments and lock."""
    out = {}
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False) and entry.name != "lock":
            st = entry.stat(follow_symlinks=False)
            out[entry.name] = (st.st_ino, st.st_size)
    return out


def bytes_written(before: dict, after: dict) -> int:
    """Growth of a file appended to, or the whole size of a file replaced (a new inode)."""
    total = 0
    for name, (ino, size) in after.items():
        old_ino, old_size = before.get(name, (None, 0))
        total += size - old_size if ino == old_ino else size
    return total


def make_durable(folder: Path) -> None:
    """fsync every file and folder of a fresh copy. Otherwise the save's own fsync would
    also flush the copy of every earlier record (a conversation saved turn by turn has
    fsynced those already), and the late turn would pay for the size of the copy."""
    for directory, _, names in os.walk(folder):
        for path in [Path(directory) / n for n in names] + [Path(directory)]:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def prepare(snapshots: dict[str, Path], cid: str, root: Path, repeats: int) -> dict:
    """A durable copy of each snapshot for each repeat, all made before any is measured:
    copying 200 segments right before a save would make that save's fsyncs queue behind
    the copy's, and only the late turn's."""
    stores = {}
    for name, snapshot in snapshots.items():
        for repeat in range(repeats):
            store_root = root / f"store-{name}-{repeat}"
            folder = store_root / "conversations" / cid
            shutil.copytree(snapshot, folder)
            make_durable(folder)
            stores[name, repeat] = store_root
    os.sync()
    return stores


def measure_once(store_root: Path, cid: str, turn: dict) -> dict[str, float]:
    """Open the prepared copy and time the save of ``turn``."""
    from kvchat.storage import ConversationStore

    store = ConversationStore(store_root)
    folder = store.conversations_dir / cid
    with store.open(cid) as conv:
        before = files_beside_segments(folder)
        harness.collect()
        t0 = time.perf_counter()
        times = conv.append_turn(**turn)  # the save says where its time went
        total = time.perf_counter() - t0
        written = bytes_written(before, files_beside_segments(folder))
    return {"manifest_s": total - times.segment_seconds, "total_s": total, "bytes": written}


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-save-", dir=args.tmp) as tmp:
        root = Path(tmp)
        harness.say(f"building a {args.turns}-turn conversation in {root} ...")
        cid, early, late, turns = build(root, args)
        late_name = str(args.turns)
        cases = {"2": turns[0], late_name: turns[1]}
        stores = prepare({"2": early, late_name: late}, cid, root, args.repeats)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
        for repeat in range(args.repeats):
            for name in harness.rotated(list(cases), repeat):
                runs[name].append(measure_once(stores[name, repeat], cid, cases[name]))
        harness.say(f"{args.repeats} repeats done")
    return {"conversation_id": cid, "runs": runs}


def summarize(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    runs = result["runs"]
    early, late = runs["2"], runs[str(args.turns)]
    ratios = [b["manifest_s"] / a["manifest_s"] for a, b in zip(early, late)]
    summary = {
        name: {
            "manifest_ms_median": harness.median([r["manifest_s"] for r in rs]) * 1e3,
            "total_ms_median": harness.median([r["total_s"] for r in rs]) * 1e3,
            "manifest_spread": harness.spread([r["manifest_s"] for r in rs]),
            "bytes_written": harness.median([r["bytes"] for r in rs]),
        }
        for name, rs in runs.items()
    }
    ratio = harness.median(ratios)
    return {
        "per_turn": summary,
        "ratio_of_per_repeat_pairs": ratio,
        "ratio_of_medians": summary[str(args.turns)]["manifest_ms_median"]
        / summary["2"]["manifest_ms_median"],
        "per_repeat_ratios": ratios,
        "target": TARGET,
        "meets_target": ratio <= TARGET,
    }


def report(summary: dict[str, Any], args: argparse.Namespace) -> None:
    rows = [
        [
            f"turn {name}",
            harness.fmt(s["manifest_ms_median"], 3),
            harness.fmt(s["total_ms_median"], 3),
            f"{s['manifest_spread']:.0%}",
            harness.human_bytes(s["bytes_written"]),
        ]
        for name, s in summary["per_turn"].items()
    ]
    headers = ["save of", "manifest part ms (median)", "whole save ms", "spread", "bytes written"]
    print(harness.markdown_table(headers, rows))
    print()
    verdict = "meets" if summary["meets_target"] else "MISSES"
    print(
        f"ratio turn {args.turns} / turn 2 (manifest part, median of {args.repeats} paired "
        f"repeats): {summary['ratio_of_per_repeat_pairs']:.2f} "
        f"(ratio of medians {summary['ratio_of_medians']:.2f}); "
        f"target <= {TARGET}: {verdict}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200, help="the late turn (default 200)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=64, help="token ids per turn")
    parser.add_argument("--chars", type=int, default=400, help="message characters per turn")
    parser.add_argument(
        "--rendered",
        action="store_true",
        help="also hand over a growing rendered prompt in engine_state, as the engine does",
    )
    parser.add_argument("--tmp", default=None, help="folder for the temporary conversation")
    parser.add_argument("--json", metavar="PATH", help="write every figure here as JSON")
    args = parser.parse_args()
    if args.turns < 3 or args.repeats < 1:
        parser.error("--turns must be at least 3 and --repeats at least 1")
    import torch

    wall = harness.stopwatch()
    result = run(args)
    summary = summarize(result, args)
    report(summary, args)
    if args.json:
        fields = {
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "summary": summary,
            "runs": result["runs"],
        }
        env = harness.environment(torch.get_num_threads())
        harness.save_run(args.json, "bench_save", fields, env, wall())


if __name__ == "__main__":
    main()
