"""How kvchat measures: timing, interleaved repeats, medians and ratios, tables, JSON.

One harness for ``kvchat bench``/``kvchat verify`` (``kvchat.lab``) and the scripts in
``benchmarks/``. They run on a shared, noisy CPU, so every measurement follows these rules:

* the baseline is measured in the same process and the same run as what it is compared
  with, never taken from an earlier run;
* repeats are interleaved (``interleaved``): each repeat measures every configuration once,
  in an order that rotates from repeat to repeat, so slow drift (another job starting)
  hits all configurations alike;
* a ratio is taken per repeat between measurements made next to each other
  (``paired_ratios``) and the median over repeats is reported, with the raw medians and
  their ``spread`` beside it;
* the JSON written (``write_json``) carries the ``environment``: versions, threads, load
  average, git commit, which kvchat was measured.

No torch at import time (``kvchat --help`` stays instant); what needs it imports it.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from kvchat.units import human_bytes  # noqa: F401  (the benchmarks' tables use it)

K = TypeVar("K", bound=Hashable)
Clock = Callable[[], float]

# Dropping a file's pages needs posix_fadvise (Linux); without it there is no cold disk.
CAN_DROP_PAGES = hasattr(os, "posix_fadvise")


# -- timing --------------------------------------------------------------------------------
def stopwatch(clock: Clock = time.perf_counter) -> Callable[[], float]:
    """Start a clock; the returned function gives the seconds since."""
    start = clock()
    return lambda: clock() - start


def intervals(stamps: Sequence[float]) -> list[float]:
    """Seconds between consecutive timestamps (per-step times from a stamped loop)."""
    return [b - a for a, b in zip(stamps, stamps[1:])]


def synchronizer(device: Any) -> Callable[[], None]:
    """What to call before reading a clock so queued device work is counted (no-op on CPU)."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    if str(device).startswith("mps"):
        import torch

        return torch.mps.synchronize
    return lambda: None


def seconds_per_op(
    op: Callable[[], Any],
    prepare: Callable[[], None] | None = None,
    inner: int = 1,
    sync: Callable[[], None] | None = None,
    clock: Clock = time.perf_counter,
) -> float:
    """Mean seconds of ``inner`` calls of ``op``; with ``prepare``, each call timed alone.

    Without ``prepare`` the calls run back to back under one clock reading, so an operation
    far shorter than the clock's resolution is still measured. ``prepare`` (e.g. dropping a
    file from the page cache) runs before each call, outside the timing.
    """
    sync = sync or (lambda: None)
    if prepare is None:
        sync()
        t0 = clock()
        for _ in range(inner):
            op()
        sync()
        return (clock() - t0) / inner
    total = 0.0
    for _ in range(inner):
        prepare()
        sync()
        t0 = clock()
        op()
        sync()
        total += clock() - t0
    return total / inner


def drop_pages(path: str | os.PathLike[str]) -> None:
    """Write ``path`` out and drop it from the page cache: the next read comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- repeating -----------------------------------------------------------------------------
def collect() -> None:
    """Free what the previous configuration held before the next one is measured."""
    gc.collect()


def rotated(items: Sequence[Any], k: int) -> list[Any]:
    """``items`` rotated left by ``k``: repeat ``k`` starts with another configuration."""
    items = list(items)
    if not items:
        return items
    k %= len(items)
    return items[k:] + items[:k]


def interleaved(
    items: Iterable[K],
    repeats: int,
    measure: Callable[[K, int], Any],
    *,
    stride: int = 1,
    settle: Callable[[], None] | None = collect,
) -> dict[K, list[Any]]:
    """``measure(item, repeat)`` for every item in every repeat, the order rotating.

    Repeat ``r`` starts ``r * stride`` items further along. ``settle`` runs before each
    measurement (by default a garbage collection; None for operations of microseconds).
    Returns each item's results in repeat order.
    """
    items = list(items)
    runs: dict[K, list[Any]] = {item: [] for item in items}
    for rep in range(repeats):
        for item in rotated(items, rep * stride):
            if settle is not None:
                settle()
            runs[item].append(measure(item, rep))
    return runs


# -- statistics ----------------------------------------------------------------------------
def _known(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


def median(values: Iterable[float | None]) -> float:
    """Median of the known values (None and NaN left out); NaN when there are none."""
    known = _known(values)
    return statistics.median(known) if known else float("nan")


def spread(values: Iterable[float | None]) -> float:
    """(max - min) / median: how much the repeats disagreed, as a fraction."""
    known = _known(values)
    if len(known) < 2:
        return 0.0
    mid = statistics.median(known)
    return (max(known) - min(known)) / mid if mid else float("nan")


def paired_ratios(
    baseline: Sequence[Any], measured: Sequence[Any], key: str | None = None
) -> list[float]:
    """``baseline / measured`` pair by pair (of ``run[key]`` when runs are dicts).

    The pairs are measurements taken next to each other (the same repeat, or neighbouring
    steps); with times, > 1 means ``measured`` is faster. NaN where a pair has no
    denominator, so the list stays aligned with the repeats.
    """
    out = []
    for b, m in zip(baseline, measured):
        if key is not None:
            b, m = b[key], m[key]
        out.append(b / m if b is not None and m else float("nan"))
    return out


def median_ratio(baseline: Sequence[Any], measured: Sequence[Any], key: str | None = None) -> float:
    """Median of ``paired_ratios``: the figure a benchmark reports against its baseline."""
    return median(paired_ratios(baseline, measured, key))


# -- printing ------------------------------------------------------------------------------
def say(msg: str) -> None:
    """Progress on stderr, so stdout holds only the tables."""
    print(msg, file=sys.stderr, flush=True)


def fmt(value: float | None, digits: int = 2) -> str:
    """A figure for a table; ``-`` when unknown (None or NaN)."""
    if value is None or value != value:
        return "-"
    return f"{value:.{digits}f}"


def markdown_table(headers: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table, columns padded to their widest cell (cells shown with ``str``)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# -- provenance and JSON -------------------------------------------------------------------
def kvchat_location() -> str:
    """The folder of the kvchat package being measured (which checkout, when several)."""
    return str(Path(__file__).resolve().parent.parent)


def git_commit(cwd: str | os.PathLike[str] | None = None) -> str | None:
    """Short commit of the checkout at ``cwd`` (default: the one kvchat is imported from)."""
    folder = cwd if cwd is not None else Path(kvchat_location()).parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _version(package: str) -> str | None:
    """A package's version without importing it (torch takes seconds to import)."""
    module = sys.modules.get(package)
    if module is not None and hasattr(module, "__version__"):
        return str(module.__version__)
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    """The CPU's name as the kernel reports it (Linux), else None: runs on different kinds
    of machine (a Xeon, an EPYC) are not comparable, and a run's figures must say which."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return None


def environment(threads: int | None) -> dict[str, Any]:
    """What a reader needs to judge a run's figures: versions, machine, load, commit."""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_model": cpu_model(),
        "loadavg_at_start": load,
        "git_commit": git_commit(),
        "kvchat": kvchat_location(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "argv": sys.argv,
    }


def jsonable(value: Any) -> Any:
    """``value`` as strict JSON can hold it: NaN and infinities as strings, keys as str."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_json(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as indented JSON (folders made as needed); the path written."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(jsonable(data), indent=2) + "\n", encoding="utf-8")
    return out


def save_run(
    path: str | os.PathLike[str],
    benchmark: str,
    fields: dict[str, Any],
    environment: dict[str, Any],
    wall_seconds: float,
) -> Path:
    """Write one benchmark run's JSON and say where: its name, its figures (``fields``), the
    ``environment`` it ran in and its wall time."""
    data = {"benchmark": benchmark, **fields, "environment": environment}
    data["wall_seconds"] = wall_seconds
    out = write_json(path, data)
    say(f"wrote {out}")
    return out
