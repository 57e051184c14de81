"""The standard cache kvchat compares itself with (``--cache standard``): transformers'
``DynamicCache``, behind the same few calls the session makes on a KV-Direct cache.

It holds every token's K/V, as transformers does, and does its own ceiling check before
each forward call (``prepare``): under ``--max-mem`` it refuses a call whose K/V would not
fit, naming the fix, instead of growing past the ceiling. It has no reserve to release, no
spill files and nothing to detach, so those calls are no-ops; the session never asks which
kind of cache it holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from kvchat.engine.kvdirect.footprint import ModelFootprint
from kvchat.engine.kvdirect.interface import CallLog

if TYPE_CHECKING:
    from kvchat.engine.kvdirect.interface import CacheAccounting, SavedSegment


class StandardCache(DynamicCache):
    def __init__(self, config: Any, footprint: ModelFootprint, max_mem: int | None) -> None:
        """K/V are held in the footprint's K/V dtype (``--kv-dtype``), which the ceiling
        check counts: where it is narrower than the model computes, each new row is
        rounded once, as the KV-Direct cache rounds it."""
        super().__init__(config=config)
        self.footprint = footprint
        self.max_mem = max_mem
        self.kv_dtype = getattr(torch, footprint.kv_dtype) if footprint.kv_dtype else None
        self.hot_reserve = 0
        self.plan = None  # nothing to plan: every row stays in memory
        self.calls = CallLog()

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv_dtype is not None:
            key_states = key_states.to(self.kv_dtype)
            value_states = value_states.to(self.kv_dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def prepare(self, n_new: int) -> None:
        """Before a forward call of ``n_new`` tokens: NeedsDiskTierError when the K/V after
        it would pass the ceiling (nothing has been fed yet, so nothing is lost)."""
        self.calls.note(n_new, self.resident_bytes())
        if self.max_mem is None:
            return None
        from kvchat.errors import NeedsDiskTierError
        from kvchat.units import human_bytes

        n_after = self.get_seq_length() + n_new
        need = self.footprint.standard_cache_bytes(n_after)
        if need > self.max_mem:
            raise NeedsDiskTierError(
                f"the standard cache needs {human_bytes(need)} for {n_after} tokens, over "
                f"--max-mem {human_bytes(self.max_mem)}; use --cache kvdirect or raise --max-mem"
            )
        return None

    def resident_bytes(self) -> int:
        """Bytes of the K/V tensors held: the whole of this cache's state."""
        total = 0
        for layer in self.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    def accounting(self) -> CacheAccounting:
        """Every row is hot: no checkpoints, no scratch, nothing recomputed or read back."""
        from kvchat.engine.kvdirect.interface import CacheAccounting

        return CacheAccounting(
            hot_bytes=self.resident_bytes(),
            checkpoint_bytes=0,
            step_scratch_bytes=0,
            scratch_peak_bytes=0,
            hot_tokens=self.get_seq_length(),
            hot_window=None,
            recompute_seconds=0.0,
            read_seconds=0.0,
            plan="standard cache",
        )

    def release_reserve(self) -> bool:
        """Nothing is reserved ahead: False (no memory was given back)."""
        return False

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing is attached to the model: the tensors go with the cache."""

    # -- saving and restoring itself (the formats: saved_state.py) -----------------------
    def state(self, since: int) -> dict[str, torch.Tensor]:
        """The K/V rows at positions >= ``since``, as a segment's tensors."""
        from kvchat.engine.kvdirect.saved_state import standard_state

        return standard_state(self, since)

    def bind_saved(self, segment: SavedSegment, since: int) -> None:
        """Nothing to re-point (the segment is not read): every row stays in memory."""

    def restore(
        self, segments: Iterable[SavedSegment], n_cached: int, device: torch.device
    ) -> None:
        """Load the saved K/V rows; ValueError for a conversation holding KV-Direct state."""
        from kvchat.engine.kvdirect.saved_state import standard_from_state

        standard_from_state(self, segments, n_cached, device)
