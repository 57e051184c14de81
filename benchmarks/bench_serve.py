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

The first reply texts are printed too. They can differ (they did in the run in README.md):
re-prefilling feeds re-tokenized text in other chunks than the turns were fed in, so its
state is not the one the conversation had; kvchat continues from that very state (its
reply equals `kvchat run` on the same turns, tests/serve/test_restart.py).

Run from the repository root: ``python benchmarks/bench_serve.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
)

from tests.serve.server_process import ServerProcess  # noqa: E402

MODEL = "smollm2-135m"
GOODS = ("copper pipes", "lanterns", "maps", "barrels of oil", "rope coils", "glass lenses")
NAMES = ("Ines", "Quill", "Marta", "Tobias", "Lena", "Oskar", "Priya", "Hugo")


def notes(turn: int, lines: int, seed: int) -> str:
    rng = random.Random(seed * 1000 + turn)
    rows = [
        f"Note {turn}.{i}: crate {rng.randint(1, 999)} in bay {rng.randint(1, 40)} holds "
        f"{rng.randint(2, 500)} {rng.choice(GOODS)}, checked by {rng.choice(NAMES)}."
        for i in range(1, lines + 1)
    ]
    return "More warehouse notes.\n" + "\n".join(rows) + "\nSay 'noted'."


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build(data_dir: Path, turns: int, lines: int, reply_tokens: int, seed: int) -> list[dict]:
    server = ServerProcess(data_dir).start()
    messages: list[dict] = []
    try:
        client = server.client(timeout=600)
        for turn in range(1, turns + 1):
            messages.append({"role": "user", "content": notes(turn, lines, seed)})
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=reply_tokens
            )
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            say(f"  turn {turn}: {reply.usage.total_tokens} tokens")
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
            model=MODEL, messages=messages, max_tokens=4, stream=True
        )
        text = ""
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text = chunk.choices[0].delta.content
                break
        seconds = time.perf_counter() - started
        stream.close()
    finally:
        server.stop()
    return {"seconds": seconds, "first_text": text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=10, help="the timed turn (default 10)")
    parser.add_argument("--lines", type=int, default=14, help="note lines per user turn")
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 repeat")
    parser.add_argument("--out", default="results/bench_serve.json")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        root = Path(tmp)
        say(f"building a {args.turns - 1}-turn conversation")
        history = build(root / "saved", args.turns - 1, args.lines, args.reply_tokens, args.seed)
        request = history + [{"role": "user", "content": notes(args.turns, args.lines, args.seed)}]
        rows = []
        for r in range(repeats):
            runs = {}
            order = ["kvchat", "re-prefill"] if r % 2 == 0 else ["re-prefill", "kvchat"]
            for kind in order:
                data = root / f"{kind}-{r}"
                if kind == "kvchat":
                    shutil.copytree(root / "saved", data)
                runs[kind] = first_token(data, request)
                say(f"  repeat {r + 1} {kind}: {runs[kind]['seconds'] * 1000:.0f} ms")
            runs["ratio"] = runs["re-prefill"]["seconds"] / runs["kvchat"]["seconds"]
            rows.append(runs)
        context = _context_tokens(root / "saved")

    median = {
        kind: statistics.median(row[kind]["seconds"] for row in rows)
        for kind in ("kvchat", "re-prefill")
    }
    ratio = statistics.median(row["ratio"] for row in rows)
    texts = {kind: [row[kind]["first_text"] for row in rows] for kind in ("kvchat", "re-prefill")}
    print(f"| turn {args.turns}, ~{context} tokens of history | time to first token |")
    print("|---|---|")
    print(f"| kvchat serve, resumed from its files | {median['kvchat'] * 1000:.0f} ms |")
    print(f"| re-prefill of the text history | {median['re-prefill'] * 1000:.0f} ms |")
    print(f"| ratio (re-prefill / kvchat), median of {repeats} | {ratio:.1f}x |")
    # They may differ: see the module docstring.
    print(f"first reply text: kvchat {texts['kvchat']!r}, re-prefill {texts['re-prefill']!r}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"context_tokens": context, "median_seconds": median, "ratio": ratio}
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "repeats": rows}, indent=2))


def _context_tokens(data_dir: Path) -> int:
    from kvchat.storage import ConversationStore

    return max(row.tokens for row in ConversationStore(data_dir).list())


if __name__ == "__main__":
    main()
