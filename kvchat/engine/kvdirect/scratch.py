"""Scratch buffers a KV-Direct cache reuses across layers and steps.

Cold K/V read back from disk, the token-major rows handed to attention, streamed
attention's windows and the joined K/V of a call all go into buffers that grow to the
largest call and are then reused, so a decode step allocates nothing for them. The plan
releases the ones it no longer needs (``release``).
"""

from __future__ import annotations

import math

import torch

from kvchat.engine.kvdirect.state_store import nbytes


class ScratchBuffers:
    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}

    def buffer(
        self, name: str, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements under ``name`` (grown when short)."""
        held = self._held.get(name)
        if held is None or held.numel() < numel or held.dtype != dtype or held.device != device:
            held = self._held[name] = torch.empty(numel, dtype=dtype, device=device)
        return held[:numel]

    def read_buffer(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 CPU buffer for rows read back from disk."""
        return self.buffer("read", nbytes, torch.uint8, torch.device("cpu"))

    def rows_buffer(self, numel: int, dtype: torch.dtype, parity: int = 0) -> torch.Tensor:
        """A flat CPU buffer of token-major K/V rows handed to attention: two of them, so
        that one layer's rows are read while the layer before attends."""
        return self.buffer(f"rows{parity}", numel, dtype, torch.device("cpu"))

    def rows_buffers_bytes(self) -> int:
        return sum(nbytes(self._held[n]) for n in ("rows0", "rows1") if n in self._held)

    def window_buffer(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 CPU buffer streamed attention's windows are assembled in."""
        return self.buffer("window", nbytes, torch.uint8, torch.device("cpu"))

    def kv_buffer(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """``torch.cat(parts, dim=-2)`` into the buffer ``name``."""
        first = parts[0]
        rows = sum(p.shape[-2] for p in parts)
        shape = (*first.shape[:-2], rows, first.shape[-1])
        flat = self.buffer(name, math.prod(shape), first.dtype, first.device)
        out = flat.view(shape)
        torch.cat(parts, dim=-2, out=out)
        return out

    def release(self, names: tuple[str, ...] | None = None) -> None:
        """Drop the named buffers (all of them by default)."""
        for name in list(self._held) if names is None else names:
            self._held.pop(name, None)
