"""CPU threads that share the machine: passive OpenMP waiting after a short spin, one thread
per physical core, one thread for the single-row steps of small models.

Why: torch's OpenMP threads spin while they wait for work by default. On a machine where
anything else is busy (a browser, a compiler, another kvchat), spinning threads burn the
time slices the working threads need; measured here with one competing CPU-bound process on
2 cores, SmolLM2 decode fell to 0.55 tok/s with spinning and kept 8.4 tok/s with
``OMP_WAIT_POLICY=PASSIVE``. But a purely passive thread sleeps between every two parallel
regions, and a decode step runs a few hundred short ones, each then paying a wake-up. A
spin of 1000 rounds before sleeping (``GOMP_SPINCOUNT``) bridges the gap between two regions
of one step and gives the core up soon after; longer spins were faster when quiet and much
slower beside a busy process in trials. Earlier runs of ``python benchmarks/bench_peers.py``
compared both waits (their logs are in git history): on this noisy machine
the quiet gain showed in one run and not in another; beside a busy process the purely
passive wait was the faster of the two, and the spin kept 0.61x and 0.88x of its quiet
speed.

One row at a time on small models: a decode step (one row per call) of a small model runs
a few hundred kernels of well under a millisecond each, and with two threads every one of
them waits for the second thread to wake, a cost as large as the work it shares. So
single-row forward calls get their own thread count (:func:`decode_threads_for`: one for
models whose weights are at most :data:`SMALL_WEIGHTS` bytes, else the prefill count;
``--decode-threads`` sets it). ``python benchmarks/bench_peers.py`` compares it with
decoding on every core, quiet and beside a busy process (docs/performance.md, "bench_peers":
on the default model, faster in both). A kernel big enough to pay for the
wake-up (the output head, ``qlinear.WIDE_BYTES``) still takes every core (:func:`every_thread`),
and so do kvchat's int4 and attention kernels, whose own workers cost no such wake-up
(:func:`kernel_threads`).

Thread counts change bits: a GEMM may split its work another way. So every projection runs
under the count its row count selects (:func:`rows_threads`), both in the forward call and
when the cache replays it from a checkpoint, and a replay matches its original call bit for
bit whatever call it happens in.

libgomp reads both variables once, when torch's library loads, so :func:`prefer_passive_wait`
must run before the first ``import torch``; a policy or spin count the user set wins.
Hyper-threads share one core's vector units, so more threads than physical cores only adds
contention for GEMV-bound decode.

This module imports neither torch nor psutil at import time.
"""

from __future__ import annotations

import os

__all__ = [
    "OnThreads",
    "SMALL_WEIGHTS",
    "SPIN_COUNT",
    "apply_threads",
    "counts",
    "decode_threads_for",
    "default_threads",
    "every_thread",
    "kernel_threads",
    "prefer_passive_wait",
    "resolve_threads",
    "rows_threads",
    "set_decode_threads",
    "threads_for_rows",
]


SPIN_COUNT = "1000"  # rounds a waiting OpenMP thread spins before it sleeps (see above)
SMALL_WEIGHTS = 192 * 2**20  # SmolLM2-135M int4 (91 MiB) and int8 (~135 MiB) decode on one

# The counts in use: for calls of several rows (prefill) and of one row (decode). None:
# leave torch's count alone (nothing was loaded through kvchat.engine.models.load).
_counts: dict[str, int | None] = {"rows": None, "row": None}


def prefer_passive_wait() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy, and with a passive
    policy ``GOMP_SPINCOUNT`` = :data:`SPIN_COUNT` unless the user chose a count.

    Returns False when torch was already imported (the setting then comes too late for this
    process; it still reaches child processes).
    """
    import sys

    policy = os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if policy.strip().upper() == "PASSIVE":
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    return "torch" not in sys.modules


def default_threads() -> int:
    """Physical cores this process may run on (hyper-threads not counted), at least 1."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count() or 1
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or allowed
    except ImportError:
        physical = allowed
    return max(1, min(physical, allowed))


def resolve_threads(threads: int | None = None) -> int:
    """``threads``, or ``OMP_NUM_THREADS`` if set, or :func:`default_threads`."""
    if threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        threads = int(env) if env.isdigit() and int(env) > 0 else default_threads()
    if threads < 1:
        raise ValueError("threads must be at least 1")
    return threads


def apply_threads(threads: int | None = None) -> int:
    """Give torch ``threads`` intra-op threads (default: ``OMP_NUM_THREADS`` if set, else
    :func:`default_threads`); returns the number in use."""
    import torch

    threads = resolve_threads(threads)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    _counts["rows"] = threads
    return threads


def counts() -> dict[str, int]:
    """The counts in use, as a conversation records them: its turns' bits depend on them
    (SDPA of one row gives other bits on one thread than on two here), and ``kvchat
    repair`` rebuilds a turn under the counts it was computed with."""
    named = {"threads": _counts["rows"], "decode_threads": _counts["row"]}
    return {k: v for k, v in named.items() if v is not None}


def decode_threads_for(weights_bytes: int, threads: int) -> int:
    """The default count for single-row calls: 1 for small weights, else ``threads``."""
    return 1 if weights_bytes <= SMALL_WEIGHTS else threads


def set_decode_threads(threads: int | None) -> None:
    """Single-row forward calls (and their replays) run on ``threads`` threads."""
    if threads is not None and threads < 1:
        raise ValueError("decode threads must be at least 1")
    _counts["row"] = threads


def every_thread() -> OnThreads:
    """The prefill count, even inside a decode step: for one kernel call big enough to pay
    for waking the other threads (the output head of a small model, see ``qlinear``), whose
    kernel gives the same bits on any count."""
    return OnThreads(_counts["rows"])


def kernel_threads() -> int:
    """The count for kvchat's own C kernels (int4 weights, attention), for calls of any row
    count: the prefill count (or torch's, when nothing set one). Their bits do not depend on
    the count, and they hand work to workers of their own that wait briefly for the next
    call, so a decode step of a small model pays no wake-up per call, which is what keeps
    torch's ops on one thread there."""
    if _counts["rows"] is not None:
        return _counts["rows"]
    import torch

    return torch.get_num_threads()


def threads_for_rows(rows: int) -> int | None:
    """The count a call of ``rows`` rows runs on (None: whatever torch has)."""
    return _counts["row"] if rows == 1 and _counts["row"] is not None else _counts["rows"]


def rows_threads(rows: int) -> OnThreads:
    """Run a block on :func:`threads_for_rows` threads, then give the old count back."""
    return OnThreads(threads_for_rows(rows))


class OnThreads:
    """A block on ``want`` threads (None: torch's count as it is), the old count after."""

    def __init__(self, want: int | None) -> None:
        self.want = want
        self.before: int | None = None

    def __enter__(self) -> None:
        if self.want is not None:
            import torch

            now = torch.get_num_threads()
            if now != self.want:
                self.before = now
                torch.set_num_threads(self.want)

    def __exit__(self, *exc: object) -> None:
        if self.before is not None:
            import torch

            torch.set_num_threads(self.before)
