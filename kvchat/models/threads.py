"""CPU threads that share the machine: passive OpenMP waiting after a short spin, one thread
per physical core.

Why: torch's OpenMP threads spin while they wait for work by default. On a machine where
anything else is busy (a browser, a compiler, another kvchat), spinning threads burn the
time slices the working threads need; measured here with one competing CPU-bound process on
2 cores, SmolLM2 decode fell to 0.55 tok/s with spinning and kept 8.4 tok/s with
``OMP_WAIT_POLICY=PASSIVE``. But a purely passive thread sleeps between every two parallel
regions, and a decode step runs a few hundred short ones, each then paying a wake-up. A
spin of 1000 rounds before sleeping (``GOMP_SPINCOUNT``) bridges the gap between two regions
of one step and gives the core up soon after; longer spins were faster when quiet and much
slower beside a busy process in trials. ``python benchmarks/bench_peers.py`` prints both
waits, quiet and beside a busy process: on this noisy machine the quiet gain showed in one
run and not in another; beside a busy process the purely passive wait was the faster of the
two, and the spin kept 0.61x and 0.88x of its quiet speed (README "Threads that share the
machine").

libgomp reads both variables once, when torch's library loads, so :func:`prefer_passive_wait`
must run before the first ``import torch``; a policy or spin count the user set wins.
Hyper-threads share one core's vector units, so more threads than physical cores only adds
contention for GEMV-bound decode.

This module imports neither torch nor psutil at import time.
"""

from __future__ import annotations

import os

__all__ = ["SPIN_COUNT", "apply_threads", "default_threads", "prefer_passive_wait"]


SPIN_COUNT = "1000"  # rounds a waiting OpenMP thread spins before it sleeps (see above)


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


def apply_threads(threads: int | None = None) -> int:
    """Give torch ``threads`` intra-op threads (default: ``OMP_NUM_THREADS`` if set, else
    :func:`default_threads`); returns the number in use."""
    import torch

    if threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        threads = int(env) if env.isdigit() and int(env) > 0 else default_threads()
    if threads < 1:
        raise ValueError("threads must be at least 1")
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
