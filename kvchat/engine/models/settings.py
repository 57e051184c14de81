"""Which model to load, and how: the defaults every front end (run, the app, serve) shares.

No torch import: the command line reads its option defaults from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSettings:
    model: str | None = None  # alias, repo id, directory or .gguf (None: the default model)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "mps"
    dtype: str = "auto"  # the checkpoint's own on CPU (float16 runs as float32)
    weights: str = "auto"  # "auto" | "none" | "int8" | "int4"
    threads: int | None = None  # CPU threads (None: physical cores)
    decode_threads: int | None = None  # for one-token steps (None: by the weights' size)
