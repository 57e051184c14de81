"""Helpers shared by the benchmarks: model loading, prompts, timing, ratios, output.

Benchmarks here run on a shared, noisy CPU, so every script follows the same rules:

* the baseline (transformers' ``DynamicCache``) is measured in the same process and the
  same run as what it is compared with, never taken from an earlier run;
* repetitions are interleaved: each repeat runs every configuration once, in an order that
  rotates from repeat to repeat, so slow drift (another job starting) hits all alike;
* a ratio is computed per repeat between measurements taken next to each other, and the
  median over repeats is reported (the median of the raw figures is reported beside it).
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Before torch is imported (libgomp reads it once, at load): OpenMP threads that wait
# passively. With the default (active spinning), 2 threads on 2 cores shared with other jobs
# spin against each other's time slices: a SmolLM2 decode step measured 2000 ms median
# instead of 70 ms on this machine while two test suites ran beside it (and 95 vs 70 ms at
# a load average of ~1.3). Not compared on an idle machine (none was available): run with
# OMP_WAIT_POLICY=ACTIVE to see. An explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "smollm2-135m"

# Benchmark the engine of the checkout these scripts belong to. kvchat is normally
# pip-installed in editable mode from this very checkout, and then this changes nothing; but
# an editable install pointing at another tree would otherwise be measured silently.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


# -- setup ---------------------------------------------------------------------------------
def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def load_model(spec: str = DEFAULT_MODEL, dtype: str = "float32") -> Any:
    """The model as the engine holds it (``LoadedModel``), on CPU, with quiet transformers."""
    from transformers.utils import logging as hf_logging

    from kvchat.models.load import load
    from kvchat.models.resolve import resolve_model

    hf_logging.set_verbosity_error()
    path = resolve_model(spec).path
    return load(str(path), device="cpu", dtype=dtype)


def seeded_prompt(loaded: Any, n_tokens: int, seed: int = 0) -> list[int]:
    """Exactly ``n_tokens`` seeded random token ids, no special tokens (kvchat.lab.prompts)."""
    from kvchat.lab.prompts import seeded_ids

    return seeded_ids(loaded, n_tokens, seed)


def collect() -> None:
    """Free what the previous configuration held before the next one is measured."""
    gc.collect()


# -- statistics ----------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> float:
    """(max - min) / median: how much the repeats disagreed, as a fraction."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else float("nan")


def rotated(items: Sequence[Any], k: int) -> list[Any]:
    """``items`` rotated left by ``k``: repeat ``k`` starts with another configuration."""
    items = list(items)
    if not items:
        return items
    k %= len(items)
    return items[k:] + items[:k]


# -- formatting ----------------------------------------------------------------------------
def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return f"{value:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# -- provenance and output -----------------------------------------------------------------
def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def kvchat_location() -> str:
    import kvchat

    return str(Path(kvchat.__file__).resolve().parent)


def environment(threads: int) -> dict[str, Any]:
    import torch
    import transformers

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "loadavg_at_start": load,
        "git_commit": _git_commit(),
        "kvchat": kvchat_location(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "argv": sys.argv,
    }


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return out


# -- step-interleaved decode ---------------------------------------------------------------
def interleaved_decode(loaded: Any, entries: dict[str, Any], steps: int) -> dict[str, Any]:
    """Decode ``steps`` greedy tokens on several prefilled sessions, one step each in turn.

    ``entries`` maps a name to ``(session, next_token)``: a ``ChatSession`` whose cache is
    already prefilled (hooks detached) and the token to feed next. Each round feeds every
    session one token, in an order rotating from round to round, through the same
    ``kvchat.chat.generate.forward`` the decode loop uses, and times each call alone.
    Neighbouring calls share the machine's state, so a burst of CPU contention hits every
    configuration of a round alike: the per-round ratios are far steadier than ratios of
    whole runs. Returns per name the step times and the tokens fed.
    """
    import torch

    from kvchat.chat.generate import forward

    names = list(entries)
    state = {name: entries[name][1] for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    fed: dict[str, list[int]] = {name: [] for name in names}
    with torch.inference_mode():
        for step in range(steps):
            for name in rotated(names, step):
                session = entries[name][0]
                attach = getattr(session.cache, "attach", None)
                if attach is not None:
                    attach()
                token = state[name]
                t0 = time.perf_counter()
                logits = forward(
                    loaded.model, session.cache, [token], loaded.device, session.before_forward
                )
                state[name] = int(torch.argmax(logits).item())
                times[name].append(time.perf_counter() - t0)
                fed[name].append(token)
                session.close()
    return {"step_seconds": times, "tokens": fed}


def paired_step_ratio(base: Sequence[float], other: Sequence[float]) -> float:
    """Median over rounds of base step time / other step time (> 1: other is faster)."""
    return median([b / o for b, o in zip(base, other)])


def say(msg: str) -> None:
    """Progress on stderr, so stdout holds only the tables."""
    print(msg, file=sys.stderr, flush=True)
