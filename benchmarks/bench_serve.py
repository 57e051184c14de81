"""Serve: time to first token of turn 10 of a ~4K-token conversation after a restart.

Through real `kvchat serve` processes and the official `openai` client, streaming:

* setup (not timed): a server builds a 9-turn conversation (seeded notes of
  ``--lines`` lines per user turn, greedy replies of ``--reply-tokens``), then is stopped
  with SIGTERM. Its data dir is the saved conversation.
* ``kvchat``: a fresh server on a copy of that data dir gets turn 10 (the whole history,
  as any OpenAI client sends it); it matches the saved conversation, resumes it from its
  files and feeds only the new user message.
* ``re-prefill`` (Ollama's way): a fresh server on an empty data dir gets the same
  request; nothing matches, so it prefills the whole text history into a fresh cache.

Timed: from sending the request to the first chunk carrying reply text, client side (so
HTTP, matching and, for kvchat, reading the files are included). Both servers are fresh
processes that loaded the model before the clock starts, as after a restart; the OS page
cache is warm for the saved files (they were just written). Per repeat the two are run
back to back, the order alternating; ratio = re-prefill / kvchat, median over repeats.

With ``--edit``: the conversation is built to turn ``--turns`` (10) and the request edits
turn 9's message instead (turns 1..8 as they were, then a new message 9): kvchat forks the
saved conversation at turn 8, resumes the fork from its files and feeds only the new
message; re-prefill feeds the whole text.

Two shapes of conversation (``--shape``):

* ``notes`` (the default without ``--edit``): each user turn pastes ``--lines`` lines of
  seeded notes (~450 tokens) and the replies are short (``--reply-tokens``, 8). An edited
  message is as long as the original, so kvchat reads ~450 new tokens against re-prefill's
  ~4K: the ratio cannot pass history / message (about 9x), whatever the engine does.
* ``chat`` (the default with ``--edit``): short questions (~25 tokens) and long answers
  (up to ``--reply-tokens``, 360 there), the way people chat; the edit is another short
  question (another topic, asked more simply).

The first reply texts are printed too. They can differ (they did in a run here):
re-prefilling feeds re-tokenized text in other chunks than the turns were fed in, so its
state is not the one the conversation had; kvchat continues from that very state (its
reply equals `kvchat run` on the same turns, tests/serve/test_restart.py).

Run from the repository root: ``python benchmarks/bench_serve.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY, puts this checkout first on sys.path)

from kvchat.lab import harness  # noqa: E402
from tests.serve.server_process import ServerProcess  # noqa: E402

# The servers are child processes: they import this checkout's kvchat too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(common.REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
)

MODEL = common.DEFAULT_MODEL


def notes(turn: int, lines: int, seed: int) -> str:
    rows = common.note_lines(random.Random(seed * 1000 + turn), lines, numbering=f"{turn}.")
    return "More warehouse notes.\n" + "\n".join(rows) + "\nSay 'noted'."


TOPICS = (
    "how a lighthouse keeper spent a winter alone",
    "why bread rises and what yeast does",
    "the history of the bicycle",
    "how tides work and why there are two a day",
    "a fox who learns to fish",
    "how a city plans its water supply",
    "the life of a honeybee colony through a year",
    "how a violin is made",
    "a journey across a desert by camel",
    "how volcanoes form islands",
    "a robot who wants to become a gardener",
    "why the sky changes colour at sunset",
)


def question(turn: int, seed: int) -> str:
    """A short request for a long answer (the chat shape)."""
    topic = random.Random(seed * 1000 + turn).choice(TOPICS)
    return f"Please write a long and detailed explanation of {topic}, with examples."


def user_message(shape: str, turn: int, lines: int, seed: int) -> str:
    return question(turn, seed) if shape == "chat" else notes(turn, lines, seed)


def build(
    data_dir: Path, turns: int, shape: str, lines: int, reply_tokens: int, seed: int
) -> list[dict]:
    server = ServerProcess(data_dir).start()
    messages: list[dict] = []
    try:
        client = server.client(timeout=600)
        for turn in range(1, turns + 1):
            messages.append({"role": "user", "content": user_message(shape, turn, lines, seed)})
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=reply_tokens
            )
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            harness.say(f"  turn {turn}: {reply.usage.total_tokens} tokens")
    finally:
        server.stop()
    return messages


def first_token(data_dir: Path, messages: list[dict]) -> dict:
    """A fresh server on ``data_dir``; seconds to the first reply text of ``messages``."""
    server = ServerProcess(data_dir).start()
    try:
        client = server.client(timeout=600)
        started = time.perf_counter()
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, seconds, cached = "", None, None
        for chunk in stream:
            if seconds is None and chunk.choices and chunk.choices[0].delta.content:
                text = chunk.choices[0].delta.content
                seconds = time.perf_counter() - started
            if chunk.usage is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        stream.close()
    finally:
        server.stop()
    return {"seconds": seconds, "first_text": text, "cached_tokens": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=10, help="the timed turn (default 10)")
    parser.add_argument(
        "--shape",
        choices=["notes", "chat"],
        default=None,
        help="notes: long pasted turns, short replies; chat: short questions, "
        "long answers (default: chat with --edit, else notes)",
    )
    parser.add_argument("--lines", type=int, default=14, help="note lines per user turn")
    parser.add_argument(
        "--reply-tokens",
        type=int,
        default=None,
        help="reply cap while building (default 8 for notes, 360 for chat)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 repeat")
    parser.add_argument("--edit", action="store_true", help="edit turn N-1's message instead")
    parser.add_argument("--edit-lines", type=int, default=None, help="its lines (--lines)")
    parser.add_argument("--out", default=None, help="results/bench_serve[_edit].json")
    args = parser.parse_args()
    args.shape = args.shape or ("chat" if args.edit else "notes")
    if args.reply_tokens is None:
        args.reply_tokens = 360 if args.shape == "chat" else 8
    args.out = args.out or (
        "results/bench_serve_edit.json" if args.edit else "results/bench_serve.json"
    )
    repeats = 1 if args.quick else args.repeats
    wall = harness.stopwatch()
    env = harness.environment(threads=None)  # the servers choose their own

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        root = Path(tmp)
        built = args.turns if args.edit else args.turns - 1
        harness.say(f"building a {built}-turn conversation")
        history = build(root / "saved", built, args.shape, args.lines, args.reply_tokens, args.seed)
        if args.edit:  # turn N-1's message edited: turns 1..N-2 as they were, then the edit
            lines = args.edit_lines or args.lines
            edited = user_message(args.shape, args.turns - 1, lines, args.seed + 1)
            if args.shape == "chat":
                edited = edited.replace("long and detailed", "simple")
            request = history[: 2 * (args.turns - 2)] + [{"role": "user", "content": edited}]
        else:
            turn = user_message(args.shape, args.turns, args.lines, args.seed)
            request = history + [{"role": "user", "content": turn}]

        def measure(kind: str, r: int) -> dict:
            data = root / f"{kind}-{r}"
            if kind == "kvchat":
                shutil.copytree(root / "saved", data)
            run = first_token(data, request)
            harness.say(f"  repeat {r + 1} {kind}: {run['seconds'] * 1000:.0f} ms")
            return run

        # the order alternates: kvchat first in even repeats, re-prefill first in odd ones
        runs = harness.interleaved(["kvchat", "re-prefill"], repeats, measure, settle=None)
        ratios = harness.paired_ratios(runs["re-prefill"], runs["kvchat"], "seconds")
        rows = [
            {"kvchat": k, "re-prefill": p, "ratio": q}
            for k, p, q in zip(runs["kvchat"], runs["re-prefill"], ratios)
        ]
        context = _context_tokens(root / "saved")

    median = {kind: harness.median([run["seconds"] for run in runs[kind]]) for kind in runs}
    ratio = harness.median([row["ratio"] for row in rows])
    texts = {kind: [run["first_text"] for run in runs[kind]] for kind in runs}
    if args.edit:
        what = (
            f"turn {args.turns - 1} edited in a {args.turns}-turn, ~{context}-token chat"
            f" ({args.shape} shape)"
        )
        how = f"kvchat serve, forked at turn {args.turns - 2} from its files"
    else:
        what, how = (
            f"turn {args.turns}, ~{context} tokens of history",
            ("kvchat serve, resumed from its files"),
        )
    print(f"| {what} | time to first token |")
    print("|---|---|")
    print(f"| {how} | {median['kvchat'] * 1000:.0f} ms |")
    print(f"| re-prefill of the text history | {median['re-prefill'] * 1000:.0f} ms |")
    print(f"| ratio (re-prefill / kvchat), median of {repeats} | {ratio:.1f}x |")
    # They may differ: see the module docstring.
    print(f"first reply text: kvchat {texts['kvchat']!r}, re-prefill {texts['re-prefill']!r}")
    summary = {
        "context_tokens": context,
        "edit": args.edit,
        "shape": args.shape,
        "request_messages": len(request),
        "median_seconds": median,
        "ratio": ratio,
    }
    if args.edit:
        summary["cached_tokens"] = [run.get("cached_tokens") for run in runs["kvchat"]]
    fields = {"args": vars(args), "summary": summary, "repeats": rows}
    harness.save_run(args.out, "bench_serve", fields, env, wall())


def _context_tokens(data_dir: Path) -> int:
    from kvchat.storage import ConversationStore

    return max(row.tokens for row in ConversationStore(data_dir).list())


if __name__ == "__main__":
    main()
