"""One reading of the engine's memory accounting, as plain numbers and labels.

What the CLI memory line, ``--json``, the UI gauge and each saved turn show. It holds no
tensors and imports nothing from kvchat, so every layer (the UI included) can take it.
``to_dict``/``from_dict`` are its one serialization: the keys are the ones ``--json``
prints and saved manifests hold, and a dict saved by an older version (a key missing, or
one no longer known) still loads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class MemorySnapshot:
    cache: str = "kvdirect"  # "kvdirect" | "standard"
    checkpoint: str | None = None  # the checkpoint form, or why there is none
    tokens: int = 0
    hot_tokens: int = 0
    checkpointed_tokens: int = 0
    hot_window: int | None = None
    hot_kv_bytes: int = 0
    checkpoint_bytes: int = 0
    scratch_peak_bytes: int = 0
    token_id_bytes: int = 0
    state_bytes: int = 0  # resident conversation state now (what the ceiling bounds)
    state_peak_bytes: int = 0
    standard_equivalent_bytes: int = 0  # what a standard cache holds for the same tokens
    ceiling_bytes: int | None = None  # --max-mem
    disk_bytes: int = 0
    disk_tier: bool = False
    plan: str = ""
    forms: str | None = None
    streamed_attention: bool = False
    weights_bytes: int = 0
    rss_bytes: int | None = None  # None: not measured
    recompute_seconds: float = 0.0
    compute_seconds: float = 0.0
    recompute_share: float = 0.0
    read_back_seconds: float = 0.0
    read_back_share: float = 0.0
    kv_dtype: str = ""  # K/V held narrower than the model computes (--kv-dtype), else ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> MemorySnapshot:
        """A snapshot from ``to_dict``'s keys; missing ones take their defaults, unknown
        ones are ignored (a manifest written by another version)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in known})
