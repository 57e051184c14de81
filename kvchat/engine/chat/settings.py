"""Plain settings objects shared by the engine, the CLI and the UI (no torch import)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SamplingSettings:
    """Greedy unless a positive temperature is given."""

    temperature: float | None = None
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256

    @property
    def greedy(self) -> bool:
        return not self.temperature or self.temperature <= 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class CacheSettings:
    """Which cache holds the conversation, and under what ceiling."""

    kind: str = "kvdirect"  # "kvdirect" | "standard"
    max_mem: int | None = None  # bytes of resident conversation state
    hot_window: int | None = None  # explicit B (upper bound under a ceiling)
    checkpoint: str = "auto"  # "residual" | "kv" | "auto"
    prefill_chunk: int = 256

    def as_dict(self) -> dict:
        return asdict(self)
