"""The model fits the machine: a Gemma-3-4B-shaped bf16 checkpoint under kvchat's defaults.

Writes (once, reused after) a safetensors checkpoint with Gemma 3 4B's text config and random
bf16 weights (7.8 GB; the real Gemma 3 tokenizer from the Gemma 3 270M model kvchat
fetches), then runs each row in a fresh process: load, one ~600-token prompt of real text,
16 greedy tokens.

* ``default, first start``: ``--weights auto --dtype auto`` in an empty cache, so loading
  includes quantizing the checkpoint tensor by tensor to int4;
* ``default``: the same with the small form cached;
* ``default, --max-mem 64MB``: the same under the headline ceiling;
* ``--weights none``: the checkpoint as it is, bf16 (the baseline measured in this run).

With ``--repeats N`` the ``default`` and ``--weights none`` rows run N times each, taking
turns (the order swapping every repeat), and each row shows its median; decode against the
baseline is then the median of the N paired ratios, since single runs of each moved this
ratio across its target from one run to the next on this shared machine.

Printed per row: weights resident, RSS after the reply, peak RSS (``VmHWM``, loading
included), load seconds, prefill and decode tok/s, and the targets' ratios: RSS against the
checkpoint's bytes, peak against final RSS, decode against the ``--weights none`` row.

Run from the repository root: ``python benchmarks/bench_fit.py [--repeats 3]
[--json docs/results/bench_fit/run.json] [--dir /var/tmp/kvchat-gemma-3-4b-bf16]``.
About 15 minutes on 2 cores, 8 GB of disk for the checkpoint and 3 GB for its small form.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch is imported)

from kvchat.lab import harness  # noqa: E402

ROWS = {
    "default, first start": {"weights": "auto", "fresh_cache": True},
    "default": {"weights": "auto"},
    "default, --max-mem 64MB": {"weights": "auto", "max_mem": 64_000_000},
    "--weights none (bf16 as stored)": {"weights": "none"},
}
BASELINE = "--weights none (bf16 as stored)"


def write_checkpoint(target: Path) -> Path:
    """Gemma 3 4B's text model, random bf16 weights, one tensor at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvchat.engine.kvdirect.footprint import bundled_config_dict, config_from_dict
    from kvchat.engine.models.meta_init import parameters_on_meta
    from kvchat.engine.models.resolve import resolve_model
    from kvchat.engine.models.weights_file import TensorWriter

    if (target / "model.safetensors").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    config = config_from_dict(bundled_config_dict("gemma-3-4b")).get_text_config()
    config.architectures = ["Gemma3ForCausalLM"]
    config.dtype = "bfloat16"
    with parameters_on_meta():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    harness.say(f"writing a Gemma-3-4B-shaped bf16 checkpoint to {target}")
    writer = TensorWriter(target / "model.safetensors", {"format": "pt"})
    generator = torch.Generator().manual_seed(0)
    seen: set[int] = set()
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        if id(param) in seen:  # the tied head
            continue
        seen.add(id(param))
        values = torch.empty(param.shape, dtype=torch.float32)
        if name.endswith("norm.weight"):
            values.zero_()  # Gemma's norms scale by (1 + w)
        else:
            values.normal_(0.0, 0.02, generator=generator)
        writer.add(name, values.to(torch.bfloat16))
        del values
    writer.publish()
    config.save_pretrained(target)
    tokenizer_dir = resolve_model("gemma-3-270m").path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, target / name)
    return target


def measure(row: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.chat.settings import CacheSettings
    from kvchat.engine.models.load import load

    t0 = time.perf_counter()
    loaded = load(args.dir, device="cpu", dtype="auto", weights=row["weights"])
    load_seconds = time.perf_counter() - t0
    session = ChatSession(loaded, cache=CacheSettings(max_mem=row.get("max_mem")))
    ids = common.prompt_from_file(args.ids_file)
    reply = common.timed_reply(loaded, session, ids, args.new_tokens)
    mem = session.memory()
    return reply | {
        "weights": loaded.weights_mode,
        "dtype": loaded.dtype,
        "weights_bytes": loaded.weights_bytes,
        "load_seconds": load_seconds,
        "state_bytes": mem.state_bytes,
        "disk_bytes": mem.disk_bytes,
    }


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One row in a fresh process. Every row shares one cache directory of the benchmark's
    own, empty when the first row starts, so that row quantizes and the others find the
    small form it wrote."""
    env = dict(os.environ, KVCHAT_CACHE_DIR=args.cache)
    if ROWS[name].get("fresh_cache"):
        shutil.rmtree(args.cache, ignore_errors=True)
    cmd = [sys.executable, __file__, "--one", name, "--dir", args.dir,
           "--ids-file", args.ids_file, "--new-tokens", str(args.new_tokens)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr or "").strip().splitlines()[-3:]
        raise RuntimeError(f"{name} failed: {' | '.join(tail)}")
    return json.loads(lines[-1].removeprefix("RESULT "))


# Figures of a row that differ from run to run (the rest, tokens and sizes, do not).
MEDIAN_FIELDS = ("load_seconds", "prefill_tps", "decode_tps", "rss_bytes", "peak_rss_bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/var/tmp/kvchat-gemma-3-4b-bf16")
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", default="results/bench_fit.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--ids-file", help=argparse.SUPPRESS)

    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(ROWS[args.one], args)))
        return

    wall = harness.stopwatch()
    env = harness.environment(0)
    harness.say(f"load average at start: {env['loadavg_at_start']}")
    directory = write_checkpoint(Path(args.dir))
    args.dir = str(directory)
    args.cache = tempfile.mkdtemp(prefix="kvchat-fit-cache-", dir=directory.parent)
    checkpoint_bytes = (directory / "model.safetensors").stat().st_size
    args.ids_file = common.story_prompt_file(args.dir, args.prompt_tokens, args.json)

    def measure_row(name: str, _repeat: int = 0) -> dict[str, Any]:
        harness.say(f"running: {name}")
        result = run_row(name, args)
        harness.say(f"  {json.dumps({k: v for k, v in result.items() if k != 'tokens'})}")
        return result

    # The first start, then the default and the baseline taking turns (the order swapping
    # every repeat, so drift in the machine's speed falls on both), then the bounded row.
    runs = {"default, first start": [measure_row("default, first start")]}
    runs |= harness.interleaved(["default", BASELINE], max(1, args.repeats), measure_row)
    runs["default, --max-mem 64MB"] = [measure_row("default, --max-mem 64MB")]
    runs = {name: runs[name] for name in ROWS}
    results = {name: common.median_row(r, MEDIAN_FIELDS) for name, r in runs.items()}
    paired = harness.paired_ratios(runs["default"], runs[BASELINE], "decode_tps")
    base = results[BASELINE]
    rows = []
    for name, r in results.items():
        rows.append([
            name, f"{r['weights']} / {r['dtype']}", harness.human_bytes(r["weights_bytes"]),
            harness.human_bytes(r["rss_bytes"]), harness.human_bytes(r["peak_rss_bytes"]),
            f"{r['load_seconds']:.0f} s", f"{r['prefill_tps']:.1f}", f"{r['decode_tps']:.2f}",
            f"{r['rss_bytes'] / checkpoint_bytes:.2f}x",
            f"{r['peak_rss_bytes'] / r['rss_bytes']:.2f}x",
            f"{r['decode_tps'] / base['decode_tps']:.2f}x",
        ])  # fmt: skip
    if len(paired) > 1:
        rows[list(results).index("default")][-1] = f"{harness.median(paired):.2f}x"
    print(f"checkpoint: {harness.human_bytes(checkpoint_bytes)} of bf16 safetensors; prompt "
          f"{base['prompt_tokens']} tokens, {args.new_tokens} greedy tokens")  # fmt: skip
    if len(paired) > 1:
        print(f"default and --weights none ran {len(paired)} times each, taking turns; each row "
              "shows its median, and the default's decode / none is the median of the paired "
              f"ratios ({', '.join(f'{x:.2f}' for x in paired)})")  # fmt: skip
    print(
        harness.markdown_table(
            [
                "run",
                "weights / dtype",
                "weights",
                "RSS",
                "peak RSS",
                "load",
                "prefill tok/s",
                "decode tok/s",
                "RSS / checkpoint",
                "peak / RSS",
                "decode / none",
            ],
            rows,
        )  # fmt: skip
    )
    same = results["default, --max-mem 64MB"]["tokens"] == results["default"]["tokens"]
    bounded = results["default, --max-mem 64MB"]["decode_tps"] / results["default"]["decode_tps"]
    print(f"--max-mem 64MB: decode {bounded:.2f}x the unbounded default's; same tokens: {same}")
    print(f"load average at end: {os.getloadavg()}")
    shutil.rmtree(args.cache, ignore_errors=True)
    harness.save_run(
        args.json,
        "bench_fit",
        {"checkpoint_bytes": checkpoint_bytes, "results": results, "runs": runs,
         "paired_decode_ratios": paired, "bounded_same_tokens": same,
         "bounded_decode_ratio": bounded},
        env,
        wall(),
    )  # fmt: skip


if __name__ == "__main__":
    main()
