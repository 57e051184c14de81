"""What only the benchmarks share: setup, the engine's decode step, their prompts.

How they time, repeat, summarise and write JSON is ``kvchat.lab.harness``, the harness
``kvchat bench`` uses too (its docstring has the rules every script follows).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Before torch is imported (libgomp reads it once, at load): OpenMP threads that wait
# passively. With the default (active spinning), 2 threads on 2 cores shared with other jobs
# spin against each other's time slices: a SmolLM2 decode step measured 2000 ms median
# instead of 70 ms on this machine while two test suites ran beside it (and 95 vs 70 ms at
# a load average of ~1.3). Not compared on an idle machine (none was available): run with
# OMP_WAIT_POLICY=ACTIVE to see. An explicit setting in the environment wins. With it, the
# short spin kvchat itself sets (GOMP_SPINCOUNT, see kvchat.threads).
# A benchmark measuring another engine as its users run it (llama.cpp's ggml and torch both
# use libgomp) starts that child with AS_LAUNCHED=1 and the environment it was launched in.
from kvchat.threads import prefer_passive_wait  # noqa: E402  (imports no torch)

AS_LAUNCHED = "KVCHAT_BENCH_AS_LAUNCHED"
LAUNCH_ENV = {k: v for k, v in os.environ.items() if k != AS_LAUNCHED}
if os.environ.get(AS_LAUNCHED) != "1":
    prefer_passive_wait()

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "smollm2-135m"

# Benchmark the engine of the checkout these scripts belong to. kvchat is normally
# pip-installed in editable mode from this very checkout, and then this changes nothing; but
# an editable install pointing at another tree would otherwise be measured silently.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kvchat.lab import harness  # noqa: E402  (after the path: this checkout's kvchat)

# An editable install made by setuptools maps ``kvchat`` through a meta-path finder, which
# comes before sys.path: then the line above cannot win, and another tree would be measured.
if Path(harness.kvchat_location()).parent != REPO_ROOT:
    sys.exit(
        f"kvchat is imported from {harness.kvchat_location()}, not from this checkout "
        f"({REPO_ROOT}): run `pip install -e {REPO_ROOT}` first"
    )


# -- setup ---------------------------------------------------------------------------------
def add_run_options(parser: argparse.ArgumentParser, benchmark: str, quick: str) -> None:
    """The options every in-process engine benchmark takes, after its own (README: Common)."""
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out", default=f"results/{benchmark}.json")


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def load_model(spec: str = DEFAULT_MODEL, dtype: str = "float32") -> Any:
    """The model as the engine holds it (``LoadedModel``), on CPU, with quiet transformers."""
    from transformers.utils import logging as hf_logging

    from kvchat.engine.models.load import load
    from kvchat.engine.models.resolve import resolve_model

    hf_logging.set_verbosity_error()
    path = resolve_model(spec).path
    return load(str(path), device="cpu", dtype=dtype, weights="none")


# -- the engine's decode, timed ------------------------------------------------------------
def stamped_generate(
    loaded: Any,
    session: Any,
    prompt: list[int],
    new_tokens: int,
    chunk: int,
    at_decode: Callable[[], None] | None = None,
) -> tuple[Any, list[float]]:
    """kvchat's ``generate`` on ``session``'s cache, driven as the session drives it.

    Exactly ``new_tokens`` greedy tokens (no stop ids), the prompt prefilled in chunks of
    ``chunk``. Returns the outcome and the decode step times: from one decode forward call
    to the next, i.e. one step = argmax + forward. ``at_decode`` runs once, right before the
    first decode forward call (to read counters the prefill left).
    """
    from kvchat.engine.chat.generate import generate
    from kvchat.engine.chat.settings import SamplingSettings

    calls: list[float] = []

    def on_token(_token: int) -> None:
        # Each token is chosen right before its decode forward call: one stamp a step.
        if not calls and at_decode is not None:
            at_decode()
        calls.append(time.perf_counter())

    outcome = generate(
        loaded.model,
        session.cache,
        prompt,
        device=loaded.device,
        settings=SamplingSettings(max_new_tokens=new_tokens),
        stop_ids=set(),
        prefill_chunk=chunk,
        on_token=on_token,
    )
    assert len(outcome.tokens) == new_tokens, outcome.finish_reason
    return outcome, harness.intervals(calls)


def source_at(revision: str | None, source: Path, directory: Path) -> Path:
    """``source`` (a file of this checkout) as it was at git ``revision`` (None: as it is
    now), written into ``directory``; the written file's path."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    target = directory / f"{source.stem}-{revision or 'checkout'}{source.suffix}"
    if revision is None:
        text = source.read_text()
    else:
        relative = source.resolve().relative_to(root).as_posix()
        text = subprocess.run(
            ["git", "show", f"{revision}:{relative}"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    target.write_text(text)
    return target


def alternating_timings(
    ours: Callable[[], Any], theirs: Callable[[], Any], repeats: int, calls: int
) -> tuple[list[float], list[float]]:
    """Seconds per call of two functions timed in turn, ``repeats`` times each, the order
    swapped every repeat (so neither always runs on a warmer machine); each timing is the
    mean of ``calls`` calls after one to warm up."""

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - started) / calls

    ours_s: list[float] = []
    theirs_s: list[float] = []
    for r in range(repeats):
        pair = [(ours, ours_s), (theirs, theirs_s)]
        for fn, into in pair if r % 2 == 0 else reversed(pair):
            into.append(timed(fn))
    return ours_s, theirs_s


def greedy_run(
    loaded: Any, cache: Any, ids: list[int], new_tokens: int
) -> tuple[list[float], list[int]]:
    """Exactly ``new_tokens`` greedy tokens after ``ids`` on ``cache`` (prefill in chunks of
    256, no stop ids): when each token arrived (``time.perf_counter``), and the tokens."""
    from kvchat.engine.chat.generate import generate
    from kvchat.engine.chat.settings import SamplingSettings

    stamps: list[float] = []
    tokens: list[int] = []

    def on_token(token: int) -> None:
        stamps.append(time.perf_counter())
        tokens.append(int(token))

    generate(
        loaded.model,
        cache,
        ids,
        device=loaded.device,
        settings=SamplingSettings(max_new_tokens=new_tokens),
        stop_ids=set(),
        prefill_chunk=256,
        on_token=on_token,
    )
    return stamps, tokens


def median_row(runs: list[dict[str, Any]], fields: tuple[str, ...]) -> dict[str, Any]:
    """One row from its repeats: the median of each of ``fields``, everything else (the
    tokens, the weights) from the first run. Every run must have given the same tokens."""
    if any(r["tokens"] != runs[0]["tokens"] for r in runs):
        raise RuntimeError("a row gave other tokens on another run")
    row = dict(runs[0])
    for field in fields:
        if field in row:
            row[field] = harness.median([r[field] for r in runs])
    return row


def timed_reply(loaded: Any, session: Any, ids: list[int], new_tokens: int) -> dict[str, Any]:
    """:func:`greedy_run` on ``session``'s cache: :func:`reply_figures` of it, with the
    tokens."""
    t0 = time.perf_counter()
    stamps, tokens = greedy_run(loaded, session.cache, ids, new_tokens)
    return reply_figures(len(ids), t0, stamps) | {"tokens": tokens}


def session_reply(
    loaded: Any,
    prompt: list[int],
    new_tokens: int,
    *,
    cache: Any = None,
    spill_root: Path | None = None,
    on_token: Callable[[int], None] | None = None,
) -> Any:
    """One greedy reply of exactly ``new_tokens`` after ``prompt`` through a fresh
    ``ChatSession`` (``cache``: its ``CacheSettings``) and kvchat's ``generate``, the prompt
    in chunks of 256; the session is closed after."""
    from kvchat.engine.chat.generate import generate
    from kvchat.engine.chat.session import ChatSession
    from kvchat.engine.chat.settings import SamplingSettings

    session = ChatSession(loaded, cache=cache, spill_root=spill_root)
    try:
        return generate(
            loaded.model, session.cache, prompt, device=loaded.device,
            settings=SamplingSettings(max_new_tokens=new_tokens), stop_ids=set(),
            prefill_chunk=256, on_token=on_token,
        )  # fmt: skip
    finally:
        session.close()


def decode_rate(loaded: Any, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """:func:`session_reply` timed from its first token to its last: ``decode_tok_s``,
    ``seconds_per_token`` and the greedy ``tokens``."""
    stamps: list[float] = []
    out = session_reply(
        loaded, prompt, new_tokens, on_token=lambda _t: stamps.append(time.perf_counter())
    )
    tps = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return {"decode_tok_s": tps, "seconds_per_token": 1 / tps, "tokens": out.tokens}


def timed_step(loaded: Any, session: Any, token: int) -> tuple[int, float]:
    """Feed ``token`` to ``session``'s cache as the decode loop does: (next greedy token, s).

    The time is one decode step: the forward call (``kvchat.engine.chat.generate.forward``,
    which has the cache prepare for it) and the argmax. Call under ``torch.inference_mode``.
    """
    import torch

    from kvchat.engine.chat.generate import forward

    t0 = time.perf_counter()
    logits = forward(loaded.model, session.cache, [token], loaded.device)
    nxt = int(torch.argmax(logits).item())
    return nxt, time.perf_counter() - t0


def attached_step(loaded: Any, session: Any, token: int) -> tuple[int, float]:
    """``timed_step`` on a session whose cache hooks are detached between steps.

    Several prefilled sessions share one model; only the one stepping may have its hooks on
    it, so each step attaches them first and detaches them (``session.close``) after.
    """
    attach = getattr(session.cache, "attach", None)
    if attach is not None:
        attach()
    try:
        return timed_step(loaded, session, token)
    finally:
        session.close()


def stamping_processor(stamps: list[float]) -> Any:
    """A logits processor for ``model.generate`` that appends ``perf_counter()`` to ``stamps``.

    generate calls it once per generated token, right after the forward call that produced
    that token's logits: the first stamp ends the prefill, the rest time the decode steps.
    """
    from transformers import LogitsProcessor

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            stamps.append(time.perf_counter())
            return scores

    return Stamp()


def interleaved_decode(loaded: Any, entries: dict[str, Any], steps: int) -> dict[str, Any]:
    """Decode ``steps`` greedy tokens on several prefilled sessions, one step each in turn.

    ``entries`` maps a name to ``(session, next_token)``: a ``ChatSession`` whose cache is
    already prefilled (hooks detached) and the token to feed next. Each round feeds every
    session one token, in an order rotating from round to round, and times each step alone.
    Neighbouring steps share the machine's state, so a burst of CPU contention hits every
    configuration of a round alike: the per-round ratios are far steadier than ratios of
    whole runs. Returns per name the step times and the tokens fed.
    """
    import torch

    names = list(entries)
    state = {name: entries[name][1] for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    fed: dict[str, list[int]] = {name: [] for name in names}
    with torch.inference_mode():
        for step in range(steps):
            for name in harness.rotated(names, step):
                token = state[name]
                state[name], seconds = attached_step(loaded, entries[name][0], token)
                times[name].append(seconds)
                fed[name].append(token)
    return {"step_seconds": times, "tokens": fed}


# -- one reply's figures, in a process of its own ----------------------------------------
def rss_bytes() -> int:
    """psutil directly, not ``kvchat.engine.chat.memory``: the peers' processes import as little of
    kvchat as they can, so their RSS stays theirs."""
    import psutil

    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int | None:
    """The process's highest RSS so far (loading included), as the kernel counted it.

    ``VmHWM`` belongs to this process image; ``ru_maxrss`` would not do, because it survives
    ``execve`` and so starts at the driver's RSS at the fork. None off Linux.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reply_figures(n_prompt: int, t0: float, stamps: list[float]) -> dict[str, Any]:
    """Prefill and decode tok/s of one reply started at ``t0`` whose tokens arrived at
    ``stamps``, with the process's RSS now and at its peak."""
    prefill = stamps[0] - t0
    decode = stamps[-1] - stamps[0]
    return {
        "prompt_tokens": n_prompt,
        "new_tokens": len(stamps),
        "prefill_tps": n_prompt / prefill,
        "decode_tps": (len(stamps) - 1) / decode if decode > 0 else float("nan"),
        "rss_bytes": rss_bytes(),
        "peak_rss_bytes": peak_rss_bytes(),
    }


# -- the peers' prompt: token ids handed to every process through a file ------------------
# Imports llama.cpp and, given a GGUF, evaluates a few of its tokens: a wheel built for another
# CPU imports fine and dies of an illegal instruction at its first product.
_LLAMA_PROBE = """
import sys
from llama_cpp import Llama
if len(sys.argv) > 1:
    model = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
    model.eval(model.tokenize(b"Hello there")[:4])
"""


def llama_cpp_problem(gguf: str | None = None) -> str | None:
    """None when llama.cpp runs here (on ``gguf``, if given), else why not, in one line."""
    import signal
    import subprocess

    command = [sys.executable, "-c", _LLAMA_PROBE, *([gguf] if gguf else [])]
    probe = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if probe.returncode in (-signal.SIGILL, 128 + signal.SIGILL):
        return "llama_cpp dies with an illegal instruction (built for another CPU)"
    if "No module named 'llama_cpp'" in probe.stderr:
        return "llama_cpp is not importable (pip install llama-cpp-python)"
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"]
        return f"llama.cpp did not run: {lines[-1]}"
    return None


def story_prompt_file(model_dir: str, n_tokens: int, json_path: str) -> str:
    """The first ``n_tokens`` token ids of ``kvchat.lab.texts.STORY`` (real text) written
    beside ``json_path`` as ``*.prompt.json``, for processes that must not tokenize (llama.cpp's
    imports no transformers); the file's path."""
    from transformers import AutoTokenizer

    from kvchat.lab.texts import STORY

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(STORY, add_special_tokens=False)["input_ids"][:n_tokens]
    path = Path(json_path).with_suffix(".prompt.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ids), encoding="utf-8")
    return str(path)


def prompt_from_file(path: str) -> list[int]:
    """The ids :func:`story_prompt_file` wrote."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


# -- prompts -------------------------------------------------------------------------------
GOODS = ("copper pipes", "lanterns", "maps", "barrels of oil", "rope coils", "glass lenses")
NAMES = ("Ines", "Quill", "Marta", "Tobias", "Lena", "Oskar", "Priya", "Hugo")
QUESTION = "Which crate holds the most rope coils? Answer in one sentence."


def note_lines(rng: random.Random, n: int, numbering: str = "") -> list[str]:
    """``n`` one-line inventory notes (plain text, many small facts) drawn from ``rng``."""
    return [
        f"Note {numbering}{i}: crate {rng.randint(1, 999)} in bay {rng.randint(1, 40)} holds "
        f"{rng.randint(2, 500)} {rng.choice(GOODS)}, checked by {rng.choice(NAMES)}."
        for i in range(1, n + 1)
    ]


def notes(n: int, seed: int) -> str:
    """One long user message: ``n`` seeded notes ending in a question."""
    lines = note_lines(random.Random(seed), n)
    return "Here are the warehouse notes.\n" + "\n".join(lines) + "\n" + QUESTION


def user_text(loaded: Any, target_tokens: int, seed: int) -> tuple[str, int]:
    """The longest ``notes`` text whose templated prompt has at most ``target_tokens``."""
    tok = loaded.tokenizer

    def prompt_tokens(n: int) -> int:
        messages = [{"role": "user", "content": notes(n, seed)}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    lo, hi = 1, 16
    while prompt_tokens(hi) <= target_tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # prompt_tokens(lo) <= target < prompt_tokens(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if prompt_tokens(mid) <= target_tokens else (lo, mid)
    return notes(lo, seed), prompt_tokens(lo)


def build_native_layers() -> str:
    """Build kvchat's C++ decode layers (``kvchat.engine.models.native``) before anything is timed,
    in a process of its own, so that no measured run pays for the build; what happened, in
    words."""
    import subprocess

    code = (
        "from kvchat.engine.models.native import build\n"
        "b = build.start()\n"
        "print(b.wait(600) if b else 'none (KVCHAT_NATIVE=0, no C++ compiler, or a failed build)')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=REPO_ROOT
    )
    lines = (done.stdout or done.stderr).strip().splitlines()
    return f"C++ decode layers: {lines[-1] if lines else 'no answer'}"
