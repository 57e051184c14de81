"""Run a command and report its wall time and peak memory (psutil, sampled every second).

Used for the README's test-suite figures: ``python scripts/measure_run.py bash .ci/run``.
The peak is of resident memory summed over the command's whole process tree (pytest's
workers and the ``kvchat`` processes tests start), and of its largest single process. A
one-second sample can miss a shorter spike, so both are lower bounds.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

MIB = 2**20


def tree_rss(root: psutil.Process) -> list[int]:
    """Resident bytes of ``root`` and each live descendant."""
    sizes = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            sizes.append(proc.memory_info().rss)
        except psutil.Error:  # ended between the listing and the read
            pass
    return sizes


def main(command: list[str]) -> int:
    if not command:
        print("usage: python scripts/measure_run.py COMMAND [ARG ...]", file=sys.stderr)
        return 2
    start = time.monotonic()
    child = subprocess.Popen(command)
    root = psutil.Process(child.pid)
    peak_tree = peak_one = 0
    while child.poll() is None:
        try:
            sizes = tree_rss(root)
        except psutil.Error:
            sizes = []
        peak_tree = max(peak_tree, sum(sizes))
        peak_one = max(peak_one, max(sizes, default=0))
        time.sleep(1)
    print(
        f"measure_run: exit {child.returncode}, {time.monotonic() - start:.0f} s wall, "
        f"peak RSS {peak_tree / MIB:.0f} MiB over the process tree, "
        f"{peak_one / MIB:.0f} MiB its largest process",
        file=sys.stderr,
    )
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
