"""Prefill: how long reading one long prompt takes with kvchat's attention kernel, against
torch's attention (``KVCHAT_EXACT_ATTENTION=0``) in the same run.

One process per row (the kernel is chosen when it is first loaded), the default model and
settings, a prompt of ``--tokens`` tokens (seeded warehouse notes), one greedy token. Timed:
``ChatSession.send`` from the call to the first token, i.e. the prompt's prefill. The rows
alternate, ``--repeats`` times; ratio = torch's time / the kernel's (below 1: the kernel is
slower). The kernel folds keys into each query row one at a time, which is what makes every
ceiling, chunking and row count give the same bits; this measures what that costs.

Run from the repository root: ``python benchmarks/bench_prefill.py [--tokens 1000]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (this checkout's kvchat first on sys.path)

from kvchat.lab import harness  # noqa: E402

CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import common
from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import SamplingSettings
from kvchat.engine.models.load import load
loaded = load(common.DEFAULT_MODEL, device="cpu", dtype="auto", weights="auto")
text, n = common.user_text(loaded, int(sys.argv[2]), 0)
session = ChatSession(loaded)
t0 = time.perf_counter()
result = session.send(text, SamplingSettings(max_new_tokens=1))
print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": n, "token": result.tokens}))
"""


def run(kernel: bool, tokens: int) -> dict:
    env = {**os.environ, "KVCHAT_EXACT_ATTENTION": "1" if kernel else "0"}
    here = str(Path(__file__).resolve().parent)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, here, str(tokens)],
        capture_output=True, text=True, env=env, check=True, cwd=common.REPO_ROOT,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="results/bench_prefill.json")
    args = parser.parse_args()
    wall = harness.stopwatch()
    env = harness.environment(threads=None)

    def measure(kind: str, rep: int) -> dict:
        r = run(kind == "kvchat kernel", args.tokens)
        harness.say(f"  repeat {rep + 1} {kind}: {r['seconds']:.1f} s")
        return r

    runs = harness.interleaved(["kvchat kernel", "torch attention"], args.repeats, measure)
    kernel, torch_ = runs["kvchat kernel"], runs["torch attention"]
    ratio = harness.median_ratio(torch_, kernel, "seconds")
    n = kernel[0]["tokens"]
    print(f"| {n}-token prompt, default model | prefill s | tok/s | ratio |")
    print("|---|---|---|---|")
    for name, rs in runs.items():
        s = harness.median([r["seconds"] for r in rs])
        print(f"| {name} | {s:.1f} | {n / s:.0f} | {1.0 if rs is torch_ else ratio:.2f} |")
    same = all(a["token"] == b["token"] for a, b in zip(kernel, torch_))
    print(f"first token the same: {same}")
    summary = {"tokens": n, "ratio": ratio, "same_first_token": same}
    harness.save_run(args.out, "bench_prefill", {"summary": summary, "runs": runs}, env, wall())


if __name__ == "__main__":
    main()
