"""The one interface a conversation's cache offers, whichever kind it is.

Two implementations: ``KVDirectCache`` (cache.py: the bounded exact cache) and
``StandardCache`` (standard.py: transformers' ``DynamicCache`` with its own ceiling check).
The chat session, persistence and the memory accounting use only these calls, in the
spirit of mlx-lm's cache interface (state, from_state, nbytes), so no caller asks which
kind of cache it holds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kvchat.engine.kvdirect.planner import Plan
    from kvchat.storage.segments import TensorLocation


class SavedSegment:
    """One saved turn's segment, as a cache binds or restores it: the file, where each
    tensor sits in it (read, and the file verified, only when first asked for), and its
    tensors read whole (older layouts)."""

    def __init__(
        self,
        path: Path,
        read_layout: Callable[[], dict[str, TensorLocation]],
        read_tensors: Callable[[], dict[str, torch.Tensor]],
    ) -> None:
        self.path = path
        self._read_layout = read_layout
        self.read_tensors = read_tensors

    @functools.cached_property
    def layout(self) -> dict[str, TensorLocation]:
        return self._read_layout()


@dataclass(frozen=True)
class CacheAccounting:
    """What a cache holds right now, from the bytes of its tensors (never a formula)."""

    hot_bytes: int  # K/V held for attention
    checkpoint_bytes: int  # resident checkpoints (residuals or K/V of cold rows)
    step_scratch_bytes: int  # read-back scratch of the last forward call
    scratch_peak_bytes: int  # the most scratch any call needed
    hot_tokens: int  # tokens whose K/V are held at every full-attention layer
    hot_window: int | None  # the hot window in force (None: unbounded)
    recompute_seconds: float  # spent recomputing K/V from residuals
    read_seconds: float  # spent reading rows back from disk
    plan: str  # the plan in force, in words


@dataclass
class CallLog:
    """The forward calls a cache was prepared for since the log was last taken: their rows
    (a repair replays them, because the same rows fed in other chunks give other bits) and
    the most state the cache held resident before any of them."""

    rows: list[int] = field(default_factory=list)
    peak_resident_bytes: int = 0

    def note(self, rows: int, resident_bytes: int) -> None:
        self.rows.append(rows)
        self.peak_resident_bytes = max(self.peak_resident_bytes, resident_bytes)

    def take(self) -> CallLog:
        """What was logged so far; the log starts again empty."""
        taken = CallLog(self.rows, self.peak_resident_bytes)
        self.rows, self.peak_resident_bytes = [], 0
        return taken


def prepare_call(cache: object, n_new: int) -> None:
    """Before a forward call of ``n_new`` tokens on any transformers cache: ours meet the
    ceiling and log the call (:meth:`ConversationCache.prepare`); a cache built elsewhere
    (a plain ``DynamicCache``, the lab's eviction caches) has nothing to prepare."""
    prepare = getattr(cache, "prepare", None)
    if prepare is not None:
        prepare(n_new)


def layer_input_observer(cache: object) -> Callable[[int, torch.Tensor], None] | None:
    """What a forward path that skips the model's module hooks calls with each layer's
    input (``note_layer_input``: a KV-Direct cache keeps residual checkpoints of them);
    None for a cache that keeps no inputs."""
    return getattr(cache, "note_layer_input", None)


class ConversationCache(Protocol):
    """The calls a chat session makes on its cache."""

    plan: Plan | None  # the plan in force (None: nothing planned, or nothing to plan)
    calls: CallLog  # the calls prepared for since the owner last took them (calls.take())

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def prepare(self, n_new: int) -> Plan | None:
        """Before a forward call of ``n_new`` tokens: meet the ceiling, or refuse the call
        (NeedsDiskTierError) before anything is fed; log the call in ``calls``."""
        ...

    def accounting(self) -> CacheAccounting: ...

    def resident_bytes(self) -> int: ...

    def release_reserve(self) -> bool:
        """Give back rows reserved ahead; True when memory was given back."""
        ...

    def disk_bytes(self) -> int:
        """Bytes of spill files (saved segments are the conversation's)."""
        ...

    def close(self) -> None: ...

    def state(self, since: int) -> dict[str, Any]:
        """What the cache gained at positions >= ``since``, as a segment's tensors."""
        ...

    def bind_saved(self, segment: SavedSegment, since: int) -> None:
        """After a save from ``since`` wrote ``segment``: read those rows from there."""
        ...

    def restore(
        self, segments: Iterable[SavedSegment], n_cached: int, device: torch.device
    ) -> None:
        """Rebuild the state of ``n_cached`` tokens from saved segments, in turn order."""
        ...
