"""Where the default chat process's RSS goes: RSS after each step of one reply, in order.

One process, as ``kvchat`` runs it: python alone; ``import torch``; ``import transformers``;
transformers' Llama modeling code (what loading any model imports); the default model
loaded with its default weights (``kvchat.models.load``); one reply (the same 500-token
prompt as ``bench_peers.py``, 64 greedy tokens, the default KV-Direct cache). Each line is
the RSS then and what that step added. Which optional packages the modeling import pulled
in (accelerate, scipy, sympy, ...) is printed too: they depend on what is installed.

Run from the repository root: ``python benchmarks/bench_rss.py`` (~30 s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch is imported)

from kvchat.chat.memory import process_rss as rss  # noqa: E402  (imports no torch)
from kvchat.lab import harness  # noqa: E402

HEAVY = ("accelerate", "scipy", "sympy", "torch._dynamo", "torch.distributed.tensor", "boto3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", default="results/bench_rss.json")
    args = parser.parse_args()
    wall = harness.stopwatch()
    steps: list[tuple[str, int]] = [("python, kvchat's lab helpers", rss())]

    def step(label: str) -> None:
        steps.append((label, rss()))

    import torch  # noqa: F401

    step("import torch")
    import transformers  # noqa: F401

    step("import transformers")
    from kvchat.models.lean_imports import leave_out_scipy

    leave_out_scipy()  # as kvchat.models.load does first
    import transformers.models.llama.modeling_llama  # noqa: F401

    step("transformers' Llama modeling code")
    from kvchat.chat.session import ChatSession
    from kvchat.lab.texts import STORY
    from kvchat.models.load import load

    loaded = load(args.model, weights="auto")
    step(
        f"model loaded ({loaded.weights_mode} weights: {harness.human_bytes(loaded.weights_bytes)})"
    )
    session = ChatSession(loaded)
    ids = loaded.tokenizer(STORY, add_special_tokens=False)["input_ids"][: args.context]
    common.stamped_generate(loaded, session, ids, args.new_tokens, chunk=256)
    state = session.cache.hot_bytes() + session.cache.checkpoint_bytes()
    step(f"one reply ({len(ids)} + {args.new_tokens} tokens; K/V {harness.human_bytes(state)})")

    previous = 0
    rows = []
    for label, value in steps:
        rows.append([label, harness.human_bytes(value), harness.human_bytes(value - previous)])
        previous = value
    print(f"{args.model}: RSS after each step of one process")
    print(harness.markdown_table(["step", "RSS", "added"], rows))
    pulled = [name for name in HEAVY if name in sys.modules]
    print(f"optional packages imported by the modeling code: {', '.join(pulled) or 'none'}")
    fields = {"steps": steps, "imported": pulled}
    harness.save_run(args.json, "bench_rss", fields, harness.environment(None), wall())


if __name__ == "__main__":
    main()
