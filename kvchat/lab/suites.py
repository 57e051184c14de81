"""Which experiments ``kvchat verify`` and ``kvchat bench`` run, imported only when run."""

from __future__ import annotations

import importlib

from kvchat.lab.runner import Experiment

# name -> "module:function"; order is the order of the report.
VERIFY = {
    "footprint": "kvchat.lab.footprint:run",
    "identity": "kvchat.lab.identity:run",
    "markov": "kvchat.lab.markov:run",
    "nocache": "kvchat.lab.nocache:run",
}
BENCH = {
    "eviction": "kvchat.lab.eviction:run",
    "conversation": "kvchat.lab.conversation:run",
    "latency": "kvchat.lab.latency:run",
}
SUITES = {"verify": VERIFY, "bench": BENCH}


def experiments(kind: str, only: tuple[str, ...] = ()) -> list[tuple[str, Experiment]]:
    table = SUITES[kind]
    unknown = [name for name in only if name not in table]
    if unknown:
        raise ValueError(
            f"unknown {kind} experiment {', '.join(unknown)}; choose from {', '.join(table)}"
        )
    chosen = [name for name in table if not only or name in only]
    out = []
    for name in chosen:
        module, _, func = table[name].partition(":")
        out.append((name, getattr(importlib.import_module(module), func)))
    return out
