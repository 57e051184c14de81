"""Plain settings objects shared by the engine, the CLI and the UI (no torch import)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvchat.engine.kvdirect.footprint import dtype_itemsize
from kvchat.engine.models.settings import ModelSettings
from kvchat.errors import KvchatError


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


KV_DTYPES = ("auto", "float32", "bfloat16")


def kv_dtype_for(choice: str, compute_dtype: Any) -> str:
    """The dtype a conversation's K/V are held in (``--kv-dtype``): ``auto`` is the model's
    compute dtype; ``bfloat16`` narrows a float32 model's K/V (half the state and the disk
    tier's bytes). Both caches hold the same dtype, so a ceiling still changes no bit; wider
    than the model computes would only cost memory, and is refused."""
    compute, _ = dtype_itemsize(compute_dtype)
    if choice in ("auto", compute):
        return compute
    if choice == "bfloat16" and compute == "float32":
        return "bfloat16"
    if choice not in KV_DTYPES:
        raise KvchatError(f"unknown K/V dtype {choice!r}; use {', '.join(KV_DTYPES)}")
    raise KvchatError(
        f"this model computes in {compute}, so its K/V cannot be held in {choice}; "
        "use --kv-dtype auto"
    )


@dataclass
class CacheSettings:
    """Which cache holds the conversation, and under what ceiling."""

    kind: str = "kvdirect"  # "kvdirect" | "standard"
    max_mem: int | None = None  # bytes of resident conversation state
    hot_window: int | None = None  # explicit B (upper bound under a ceiling)
    checkpoint: str = "auto"  # "residual" | "kv" | "auto"
    prefill_chunk: int = 256
    # What K/V are held in: "auto" (the model's compute dtype) or "bfloat16"; a session
    # records the dtype it resolved to, which a resumed conversation keeps.
    kv_dtype: str = "auto"

    def as_dict(self) -> dict:
        return asdict(self)


# The command line's option names for each CacheSettings field, where they differ.
_CACHE_OPTIONS = {"kind": "cache_kind"}


@dataclass(frozen=True)
class EngineOptions:
    """The model and cache options, built once from the command line and used by run, the
    app and serve alike; an option that is absent or None takes the default above."""

    model: ModelSettings = field(default_factory=ModelSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)

    @classmethod
    def from_cli(cls, opts: Mapping[str, Any]) -> EngineOptions:
        def given(cls_: type, names: dict[str, str]) -> dict[str, Any]:
            out = {}
            for f in fields(cls_):
                value = opts.get(names.get(f.name, f.name))
                if value is not None:
                    out[f.name] = value
            return out

        return cls(
            model=ModelSettings(**given(ModelSettings, {})),
            cache=CacheSettings(**given(CacheSettings, _CACHE_OPTIONS)),
        )
