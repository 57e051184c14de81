"""The headline's scale, side by side with llama.cpp on the same file: a Gemma-3-4B-shaped
Q4_0 GGUF (random weights, the real Gemma 3 tokenizer); ``--config gemma-3-270m`` runs the
same rows on a Gemma-3-270M-shaped one.

The file is written once, by the random-weight GGUF writer given with ``--make-shape``
(``make_shape_gguf.py SOURCE.gguf CONFIG.json OUT.gguf --type Q4_0``: every tensor random
in the config's shape, every other key, the tokenizer included, copied from SOURCE), from
the Gemma 3 270M GGUF kvchat fetches (``kvchat --model gemma-3-270m`` once) and
``kvchat/engine/kvdirect/configs/<--config>.json``; or pass a file made before with
``--out-gguf``.
Every row runs in a process of its own, as a user would start it:

* ``llama.cpp``: llama-cpp-python's ``Llama`` (n_ctx 4096) on the file: the load, then the
  ~600-token prompt (the first tokens of ``kvchat.lab.texts.STORY``) and 16 greedy tokens;
* ``kvchat, first start``: ``load(file)`` with kvchat's defaults in an empty cache (reading
  the GGUF's config, tokenizer and tensor index, writing the int4 small form), then the same
  reply through kvchat's ``generate`` and default cache;
* ``kvchat``: the same again, the cache now warm (what every later start does);
* ``kvchat, ~1,000 tokens``, with no ceiling and under ``--max-mem 64MB``: the bounded pair
  on a longer context (the issue's bounded row), whose tokens must be equal;
* the bounded pair again, in one process taking turns: both sessions prefill the ~1,000
  tokens, then decode in blocks (``--pair-blocks`` of ``--pair-steps`` steps each), the
  sessions alternating block by block (the order swapping each round). The ratio of their
  median block rates is the bounded row's figure: a neighbour's burst lands on both, where
  two processes minutes apart (the rows above, 16 tokens each) can differ by a tenth
  either way from run to run. Their tokens must be equal too.

Figures: the load (the process's start to the model being ready: kvchat's includes the
first start's conversion), prefill tok/s (prompt tokens / time to the first token), decode
tok/s (15 / time from the first to the 16th token), RSS after the reply and peak RSS
(``VmHWM``), and what kvchat's cache holds for the file against the file's size. The first
start runs once; with ``--repeats N`` every other row runs N times, the rows taking turns
(the order rotating), and each figure is the median of its runs: on a shared machine one
run of each can be swayed by a neighbour (a 4B row takes about a minute on 2 cores). Ratios
are only meaningful within one run of this script.

llama.cpp must be importable (``pip install llama-cpp-python``, built for the machine: a
wheel built with AVX-512 dies with an illegal instruction on an AVX2-only CPU). Without it
the llama.cpp row is skipped, with a message.

Run from the repository root: ``python benchmarks/bench_headline.py [--repeats 3]`` (about
4 minutes a repeat on 2 cores; under a minute with ``--config gemma-3-270m``).
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

CONFIGS = common.REPO_ROOT / "kvchat" / "engine" / "kvdirect" / "configs"
LLAMA_CTX = 4096
CEILING = 64 * 2**20


# -- one row, in a process of its own -----------------------------------------------------
def measure_llama(args: argparse.Namespace) -> dict[str, Any]:
    from llama_cpp import Llama

    ids = common.prompt_from_file(args.ids_file)
    started = time.perf_counter()
    llm = Llama(model_path=args.gguf, n_ctx=LLAMA_CTX, n_threads=args.threads, verbose=False)
    loaded_at = time.perf_counter()
    stamps: list[float] = []
    tokens: list[int] = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        tokens.append(int(token))
        if len(stamps) >= args.new_tokens:
            break
    return common.reply_figures(len(ids), loaded_at, stamps) | {
        "load_s": loaded_at - started,
        "tokens": tokens,
    }


def measure_kvchat(args: argparse.Namespace) -> dict[str, Any]:
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.chat.settings import CacheSettings
    from kvchat.engine.models.load import load_with
    from kvchat.engine.models.settings import ModelSettings

    started = time.perf_counter()
    # kvchat's defaults, as `kvchat --model FILE` loads it (--weights auto --dtype auto)
    loaded = load_with(ModelSettings(model=args.gguf, threads=args.threads))
    loaded_at = time.perf_counter()
    settings = CacheSettings(max_mem=args.max_mem or None, kv_dtype=args.kv_dtype)
    session = ChatSession(loaded, cache=settings)
    ids = common.prompt_from_file(args.ids_file)
    return common.timed_reply(loaded, session, ids, args.new_tokens) | {
        "load_s": loaded_at - started,
        "weights": loaded.weights_mode,
        "weights_bytes": loaded.weights_bytes,
        "state_resident_bytes": session.cache.resident_bytes(),
        "state_disk_bytes": session.cache.disk_bytes(),
    }


def measure_pair(args: argparse.Namespace) -> dict[str, Any]:
    """The bounded pair in one process, taking turns (see the module docstring)."""
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.chat.settings import CacheSettings
    from kvchat.engine.models.load import load_with
    from kvchat.engine.models.settings import ModelSettings

    loaded = load_with(ModelSettings(model=args.gguf, threads=args.threads))
    ids = common.prompt_from_file(args.ids_file)
    sessions = {
        "unbounded": ChatSession(loaded, cache=CacheSettings(kv_dtype=args.kv_dtype)),
        "bounded": ChatSession(
            loaded, cache=CacheSettings(max_mem=args.max_mem, kv_dtype=args.kv_dtype)
        ),
    }
    tokens: dict[str, list[int]] = {name: [] for name in sessions}
    rates: dict[str, list[float]] = {name: [] for name in sessions}

    def reply(name: str, prompt: list[int], new_tokens: int) -> list[float]:
        stamps, got = common.greedy_run(loaded, sessions[name].cache, prompt, new_tokens)
        tokens[name].extend(got)
        return stamps

    for name in sessions:
        reply(name, ids, 1)
    for block in range(args.pair_blocks):
        order = list(sessions) if block % 2 == 0 else list(reversed(sessions))
        for name in order:
            # The last token is fed first (one row, as a decode step); the block's rate is
            # taken between its sampled tokens.
            stamps = reply(name, [tokens[name][-1]], args.pair_steps + 1)
            rates[name].append(args.pair_steps / (stamps[-1] - stamps[0]))
    held = sessions["bounded"].cache.resident_bytes()
    standard = sessions["unbounded"].cache.resident_bytes()
    for session in sessions.values():
        session.close()
    return {
        "decode_tps": {name: harness.median(r) for name, r in rates.items()},
        "block_rates": rates,
        "same_tokens": tokens["unbounded"] == tokens["bounded"],
        "new_tokens": len(tokens["bounded"]),
        "state_resident_bytes": {"bounded": held, "unbounded": standard},
    }


# -- the driver ------------------------------------------------------------------------------
MEDIAN_FIELDS = ("load_s", "prefill_tps", "decode_tps", "rss_bytes", "peak_rss_bytes",
                 "process_s")  # fmt: skip


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from its runs: the median of each timing and size, everything else (the
    tokens, the weights) from the first run, every run's decode rate kept."""
    row = common.median_row(runs, MEDIAN_FIELDS)
    row["decode_tps_runs"] = [r["decode_tps"] for r in runs]
    return row


def run_row(name: str, args: argparse.Namespace, env: dict[str, str], **extra: Any) -> dict:
    cmd = [
        sys.executable, __file__, "--one", name, "--gguf", args.gguf,
        "--ids-file", extra.get("ids_file", args.ids_file),
        "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
        "--max-mem", str(extra.get("max_mem", 0)),
        "--pair-blocks", str(args.pair_blocks), "--pair-steps", str(args.pair_steps),
        "--kv-dtype", args.kv_dtype,
    ]  # fmt: skip
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr or "").strip().splitlines()[-3:]
        raise RuntimeError(f"{name} failed (exit {out.returncode}): {' | '.join(tail)}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["process_s"] = time.perf_counter() - started
    if name == "pair":
        rates = result["decode_tps"]
        harness.say(
            f"pair: decode {rates['unbounded']:.2f} tok/s unbounded, {rates['bounded']:.2f} "
            "bounded (medians of the blocks)"
        )
        return result
    harness.say(
        f"{name}: load {result['load_s']:.1f} s, prefill {result['prefill_tps']:.1f} tok/s, "
        f"decode {result['decode_tps']:.2f} tok/s, RSS {harness.human_bytes(result['rss_bytes'])}"
    )
    return result


def source_gguf(given: str | None) -> Path:
    if given:
        return Path(given)
    from kvchat.engine.models.gguf_weights import gguf_path
    from kvchat.engine.models.resolve import resolve_model

    return gguf_path(resolve_model("gemma-3-270m").path)


def shape_gguf(args: argparse.Namespace) -> Path:
    from kvchat.paths import cache_dir

    target = Path(args.out_gguf or cache_dir() / "peers" / f"{args.config}-shape-Q4_0.gguf")
    if target.is_file():
        return target
    if not args.make_shape:
        sys.exit(f"no {target}: pass --make-shape PATH/make_shape_gguf.py to write it")
    target.parent.mkdir(parents=True, exist_ok=True)
    source = source_gguf(args.source)
    config = CONFIGS / f"{args.config}.json"
    harness.say(f"writing {target} from {source} ({args.make_shape})")
    subprocess.run(
        [sys.executable, str(args.make_shape), str(source), str(config), str(target),
         "--type", "Q4_0"],
        check=True, timeout=3600,
    )  # fmt: skip
    return target


def tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", default=None, help="the Gemma 3 270M GGUF (default: kvchat's)")
    parser.add_argument("--make-shape", default=None, help="the random-weight GGUF writer")
    parser.add_argument(
        "--config",
        default="gemma-3-4b",
        help="the Gemma 3 shape (a config in kvchat/engine/kvdirect/configs)",
    )
    parser.add_argument("--out-gguf", default=None, help="where the shaped GGUF is kept")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--bounded-context", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of each row but the first start, in turn"
    )
    parser.add_argument("--pair-blocks", type=int, default=8, help="blocks per session")
    parser.add_argument("--pair-steps", type=int, default=6, help="decode steps per block")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gguf", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ids-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-mem", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--kv-dtype", default="auto", choices=["auto", "bfloat16"],
        help="kvchat's K/V dtype in every row (kvchat's --kv-dtype; auto: float32 for a GGUF)",
    )  # fmt: skip
    parser.add_argument("--json", default="results/bench_headline.json")
    args = parser.parse_args()
    if args.threads is None:
        from kvchat.threads import default_threads

        args.threads = default_threads()
    if args.one:
        measure_one = {"llama.cpp": measure_llama, "pair": measure_pair}.get(
            args.one, measure_kvchat
        )
        result = measure_one(args)
        print("RESULT " + json.dumps(result))
        return

    wall = harness.stopwatch()
    env_info = harness.environment(args.threads)
    harness.say(f"load average at start: {env_info['loadavg_at_start']}; threads {args.threads}")
    args.gguf = str(shape_gguf(args))
    gguf_bytes = Path(args.gguf).stat().st_size
    from kvchat.engine.models.resolve import resolve_model

    tokenizer_dir = str(resolve_model("gemma-3-270m").path)  # the same tokenizer
    args.ids_file = common.story_prompt_file(tokenizer_dir, args.context, args.json)
    long_json = str(Path(args.json).with_suffix("")) + "-long.json"
    long_ids = common.story_prompt_file(tokenizer_dir, args.bounded_context, long_json)

    why_not = common.llama_cpp_problem(args.gguf)
    peer_env = {**common.LAUNCH_ENV, common.AS_LAUNCHED: "1"}
    long_row = {"ids_file": long_ids}
    bounded_row = {"ids_file": long_ids, "max_mem": CEILING}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        env = {**os.environ, "KVCHAT_CACHE_DIR": str(cache), "KVCHAT_OFFLINE": "1"}
        first_start = run_row("kvchat", args, env)
        cache_bytes = tree_bytes(cache / "models") + tree_bytes(cache / "weights")
        # The rows a noisy machine can sway, measured in turn (the order rotating) and
        # summarised by their medians; the first start happens once.
        plan: dict[str, tuple[str, dict[str, str], dict[str, Any]]] = {}
        if why_not is None:
            plan["llama.cpp"] = ("llama.cpp", peer_env, {})
        else:
            harness.say(f"llama.cpp row skipped: {why_not}")
        plan["kvchat"] = ("kvchat", env, {})
        plan["kvchat, ~1,000 tokens"] = ("kvchat", env, long_row)
        plan["kvchat, ~1,000 tokens, --max-mem 64MB"] = ("kvchat", env, bounded_row)

        def measure(name: str, repeat: int) -> dict[str, Any]:
            engine, row_env, extra = plan[name]
            return run_row(engine, args, row_env, **extra)

        runs = harness.interleaved(list(plan), args.repeats, measure, settle=None)
        pair = run_row("pair", args, env, **bounded_row)
        shutil.rmtree(cache, ignore_errors=True)
    rows: dict[str, dict] = {}
    if "llama.cpp" in runs:
        rows["llama.cpp"] = medians(runs.pop("llama.cpp"))
    rows["kvchat, first start"] = first_start
    rows.update({name: medians(got) for name, got in runs.items()})

    peer = rows.get("llama.cpp")
    headers = ["engine", "load s", "prefill tok/s", "decode tok/s", "RSS", "peak RSS"]
    if peer:
        headers += ["load + first token vs llama.cpp", "prefill vs llama.cpp",
                    "decode vs llama.cpp", "RSS vs llama.cpp"]  # fmt: skip
    table = []
    for name, r in rows.items():
        first = r["load_s"] + r["prompt_tokens"] / r["prefill_tps"]
        row = [
            name, f"{r['load_s']:.1f}", f"{r['prefill_tps']:.1f}", f"{r['decode_tps']:.2f}",
            harness.human_bytes(r["rss_bytes"]),
            harness.human_bytes(r["peak_rss_bytes"]) if r["peak_rss_bytes"] else "-",
        ]  # fmt: skip
        r["load_and_first_token_s"] = first
        if peer:
            peer_first = peer["load_s"] + peer["prompt_tokens"] / peer["prefill_tps"]
            row += [
                harness.fmt(first / peer_first),
                harness.fmt(r["prefill_tps"] / peer["prefill_tps"]),
                harness.fmt(r["decode_tps"] / peer["decode_tps"]),
                harness.fmt(r["rss_bytes"] / peer["rss_bytes"]),
            ]
        table.append(row)
    print(
        f"{args.config}-shaped Q4_0 GGUF ({harness.human_bytes(gguf_bytes)}, random weights, the "
        f"real Gemma 3 tokenizer), {args.context}-token prompt, {args.new_tokens} greedy "
        f"tokens, {args.threads} threads, kvchat's K/V in {args.kv_dtype} (--kv-dtype), "
        f"medians of {args.repeats} runs taken in turn (the "
        f"first start: one run), one process each"
    )
    print(harness.markdown_table(headers, table))
    unbounded = rows["kvchat, ~1,000 tokens"]
    bounded = rows["kvchat, ~1,000 tokens, --max-mem 64MB"]
    same = unbounded["tokens"] == bounded["tokens"]
    held = harness.human_bytes(bounded["state_resident_bytes"])
    standard = harness.human_bytes(unbounded["state_resident_bytes"])
    print(
        f"under --max-mem 64MB ({args.bounded_context}-token prompt), one process each: decode "
        f"{harness.fmt(bounded['decode_tps'] / unbounded['decode_tps'])}x kvchat's own "
        f"unbounded decode, conversation state {held} resident against {standard}; "
        f"the same tokens: {'yes' if same else 'NO'}"
    )
    pair_rates = pair["decode_tps"]
    pair["ratio"] = pair_rates["bounded"] / pair_rates["unbounded"]
    print(
        f"under --max-mem 64MB, one process taking turns ({args.pair_blocks} blocks of "
        f"{args.pair_steps} steps each): decode {harness.fmt(pair['ratio'])}x unbounded "
        f"({pair_rates['bounded']:.2f} against {pair_rates['unbounded']:.2f} tok/s, medians of "
        f"the blocks); the same {pair['new_tokens']} tokens: "
        f"{'yes' if pair['same_tokens'] else 'NO'}"
    )
    print(
        f"kvchat's cache for the file after its first start: {harness.human_bytes(cache_bytes)}, "
        f"{harness.fmt(cache_bytes / gguf_bytes)}x the GGUF"
    )
    if peer is None:
        print(f"llama.cpp row skipped: {why_not}")
    fields = {"rows": rows, "gguf_bytes": gguf_bytes, "cache_bytes": cache_bytes,
              "bounded_same_tokens": same, "bounded_pair": pair,
              "kv_dtype": args.kv_dtype}  # fmt: skip
    harness.save_run(args.json, "bench_headline", fields, env_info, wall())


if __name__ == "__main__":
    main()
