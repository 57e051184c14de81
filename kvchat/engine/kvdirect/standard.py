"""The standard cache kvchat compares itself with (``--cache standard``): transformers'
``DynamicCache``, behind the same few calls the session makes on a KV-Direct cache.

It holds every token's K/V, as transformers does, and does its own ceiling check before
each forward call (``prepare``): under ``--max-mem`` it refuses a call whose K/V would not
fit, naming the fix, instead of growing past the ceiling. It has no reserve to release, no
spill files and nothing to detach, so those calls are no-ops; the session never asks which
kind of cache it holds.
"""

from __future__ import annotations

from typing import Any

from transformers import DynamicCache

from kvchat.engine.kvdirect.footprint import ModelFootprint


class StandardCache(DynamicCache):
    def __init__(self, config: Any, footprint: ModelFootprint, max_mem: int | None) -> None:
        super().__init__(config=config)
        self.footprint = footprint
        self.max_mem = max_mem
        self.hot_reserve = 0

    def prepare(self, n_new: int) -> None:
        """Before a forward call of ``n_new`` tokens: NeedsDiskTierError when the K/V after
        it would pass the ceiling (nothing has been fed yet, so nothing is lost)."""
        if self.max_mem is None:
            return
        from kvchat.errors import NeedsDiskTierError
        from kvchat.units import human_bytes

        n_after = self.get_seq_length() + n_new
        need = self.footprint.standard_cache_bytes(n_after)
        if need > self.max_mem:
            raise NeedsDiskTierError(
                f"the standard cache needs {human_bytes(need)} for {n_after} tokens, over "
                f"--max-mem {human_bytes(self.max_mem)}; use --cache kvdirect or raise --max-mem"
            )

    def resident_bytes(self) -> int:
        """Bytes of the K/V tensors held: the whole of this cache's state."""
        total = 0
        for layer in self.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    def release_reserve(self) -> bool:
        """Nothing is reserved ahead: False (no memory was given back)."""
        return False

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing is attached to the model: the tensors go with the cache."""
