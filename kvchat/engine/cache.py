"""The KV-Direct cache: a bounded hot window of K/V, residual checkpoints, exact recompute.

It plugs into transformers as a ``Cache`` whose layers return, on every ``update``, the
same K/V tensors an unbounded ``DynamicCache`` would return, while holding only:

* the K/V of the most recent ``hot_window`` tokens (per layer);
* for every token, the residual ``h_l`` that entered layer ``l`` (captured by a forward
  pre-hook on each decoder layer), from which its K/V are recomputed when attention needs
  them and they are no longer hot.

How recompute is made bit-identical
-----------------------------------
On CPU the k/v projection GEMM gives a row a result that depends on how many rows the call
had (oneDNN/MKL pick another kernel for M=1 than for M>=2 and tile by M), so recomputing
all cold rows in one batched call differs from the cached K/V by ~1e-6 (fp32). The cache
therefore stores residuals *grouped by the forward call that produced them* (``_Call``: a
prefill chunk of M rows, or one decoded token) and replays each group with the same rows in
the same shape: norm -> projection -> k-norm -> RoPE at the original positions. Same kernel,
same inputs, same bits. ``tests/engine/test_cache_exact.py`` checks ``torch.equal`` against
``DynamicCache`` per layer, in fp32 and bf16, for every family.

The price is that each decoded token that has left the hot window costs one small GEMV per
layer per step when it is recomputed; prefill chunks cost one GEMM each. The benchmarks
measure it.

Sliding-window layers (Gemma 3, Mistral) return exactly what ``DynamicSlidingWindowLayer``
returns (the last ``window - 1`` tokens plus the new ones) and drop a call's residuals once
none of its rows can be seen again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

if TYPE_CHECKING:
    from kvchat.engine.arch import ArchAdapter

CHECKPOINT_FORMS = ("residual", "kv", "auto")


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` in storage of its own size, so a kept slice never pins a whole chunk's tensor."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == _nbytes(t):
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


@dataclass
class _Call:
    """Residual rows of one original forward call at one layer."""

    start: int
    residual: torch.Tensor  # [1, M, d]

    @property
    def end(self) -> int:
        return self.start + self.residual.shape[1]


@dataclass
class CacheStats:
    """Counters the accounting snapshot reads."""

    recompute_seconds: float = 0.0
    recomputed_tokens: int = 0
    scratch_peak_bytes: int = 0


class KVDirectLayer(CacheLayerMixin):
    """One attention layer of the KV-Direct cache."""

    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        owner: KVDirectCache,
        layer_idx: int,
        form: str,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        if form not in ("residual", "kv"):
            raise ValueError(f"unknown checkpoint form {form!r}")
        self.owner = owner
        self.layer_idx = layer_idx
        self.form = form
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.cumulative_length = 0
        self.calls: list[_Call] = []
        self.pending_residual: torch.Tensor | None = None

    # -- CacheLayerMixin -----------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))
        self.values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[-1]))
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Same figures as DynamicLayer / DynamicSlidingWindowLayer: the mask must not know
        # that part of what we return was recomputed.
        if not self.is_sliding:
            return self.cumulative_length + query_length, 0
        window = self.sliding_window
        kv_offset = max(self.cumulative_length - window + 1, 0)
        if self.cumulative_length >= window:
            return window - 1 + query_length, kv_offset
        return self.cumulative_length + query_length, kv_offset

    @property
    def hot_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.cumulative_length
        new_len = key_states.shape[-2]
        if self.form == "residual":
            residual = self.pending_residual
            if residual is None or residual.shape[1] != new_len:
                raise RuntimeError(
                    f"layer {self.layer_idx}: no residual captured for this call; "
                    "was the cache attached to the model (KVDirectCache.attach)?"
                )
            self.calls.append(_Call(start, _compact(residual)))
            self.pending_residual = None

        # Positions attention needs now: everything (full layer) or the last window - 1
        # past tokens (sliding layer), exactly as the standard cache returns them.
        visible_from = 0 if not self.is_sliding else max(0, start - self.sliding_window + 1)
        hot_from = start - self.hot_length
        parts_k, parts_v = [], []
        if self.form == "residual" and visible_from < hot_from:
            cold_k, cold_v = self._recompute(visible_from, hot_from)
            parts_k.append(cold_k)
            parts_v.append(cold_v)
        skip = max(0, visible_from - hot_from)  # hot tokens a sliding layer can no longer see
        hot_k, hot_v = self.keys[..., skip:, :], self.values[..., skip:, :]
        full_k = torch.cat([*parts_k, hot_k, key_states], dim=-2)
        full_v = torch.cat([*parts_v, hot_v, value_states], dim=-2)
        if parts_k:
            scratch = _nbytes(full_k) + _nbytes(full_v) + sum(map(_nbytes, parts_k + parts_v))
            stats = self.owner.stats
            stats.scratch_peak_bytes = max(stats.scratch_peak_bytes, scratch)

        self.cumulative_length = start + new_len
        if not parts_k and skip == 0 and self._keep_hot() >= full_k.shape[-2]:
            # Nothing leaves the window: what attention gets is the new cache, as in
            # DynamicLayer (a second concatenation cost ~10% of decode time at 2K-8K).
            self.keys, self.values = full_k, full_v
        else:
            self._retain(hot_k, hot_v, key_states, value_states)
        return full_k, full_v

    # -- internals -----------------------------------------------------------------------
    def _keep_hot(self) -> int:
        """How many of the most recent tokens keep their K/V after this step."""
        if self.form == "kv":
            keep = self.cumulative_length
        else:
            window = self.owner.hot_window
            keep = self.cumulative_length if window is None else window
        if self.is_sliding:
            keep = min(keep, self.sliding_window - 1)
        return keep

    def _retain(
        self,
        hot_k: torch.Tensor,
        hot_v: torch.Tensor,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
    ) -> None:
        keep = self._keep_hot()
        new_len = key_states.shape[-2]
        if keep <= 0:
            self.keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))
            self.values = value_states.new_empty(
                (*value_states.shape[:2], 0, value_states.shape[-1])
            )
        elif keep <= new_len:
            self.keys = _compact(key_states[..., new_len - keep :, :])
            self.values = _compact(value_states[..., new_len - keep :, :])
        else:
            old_keep = min(keep - new_len, hot_k.shape[-2])
            self.keys = torch.cat([hot_k[..., hot_k.shape[-2] - old_keep :, :], key_states], dim=-2)
            self.values = torch.cat(
                [hot_v[..., hot_v.shape[-2] - old_keep :, :], value_states], dim=-2
            )
        if self.form == "residual" and self.is_sliding:
            # A call may go once no row of it can be seen again by a later query.
            needed_from = self.cumulative_length - self.sliding_window + 1
            self.calls = [c for c in self.calls if c.end > needed_from]

    def _recompute(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions [begin, end), replayed call by call (see module docstring)."""
        t0 = time.perf_counter()
        with torch.no_grad():
            pieces = self._replay(begin, end)
        cold_k = torch.cat([k for k, _ in pieces], dim=-2)
        cold_v = torch.cat([v for _, v in pieces], dim=-2)
        stats = self.owner.stats
        stats.recompute_seconds += time.perf_counter() - t0
        stats.recomputed_tokens += end - begin
        return cold_k, cold_v

    def _replay(self, begin: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Recompute the calls overlapping [begin, end).

        Consecutive one-row calls (decoded tokens) are grouped: their norm, k-norm and RoPE
        run once over the group (row-independent), while the projection still runs one row
        per call, as it originally did.
        """
        adapter = self.owner.adapter
        idx = self.layer_idx
        calls = [c for c in self.calls if c.end > begin and c.start < end]
        pieces = []
        i = 0
        while i < len(calls):
            j = i
            if calls[i].residual.shape[1] == 1:
                while (
                    j + 1 < len(calls)
                    and calls[j + 1].residual.shape[1] == 1
                    and calls[j + 1].start == calls[j].end
                ):
                    j += 1
            group = calls[i : j + 1]
            if len(group) == 1:
                hidden = group[0].residual
                key, value = adapter.project(idx, adapter.normalize(idx, hidden))
            else:
                hidden = torch.cat([c.residual for c in group], dim=1)
                normed = adapter.normalize(idx, hidden)
                rows = [adapter.project(idx, normed[:, r : r + 1]) for r in range(len(group))]
                key = torch.cat([k for k, _ in rows], dim=1)
                value = torch.cat([v for _, v in rows], dim=1)
            first, stop = group[0].start, group[-1].end
            positions = torch.arange(first, stop, device=hidden.device).unsqueeze(0)
            k, v = adapter.finish(idx, key, value, hidden, positions)
            lo, hi = max(begin, first) - first, min(end, stop) - first
            pieces.append((k[..., lo:hi, :], v[..., lo:hi, :]))
            i = j + 1
        return pieces

    # -- accounting ----------------------------------------------------------------------
    def hot_bytes(self) -> int:
        return _nbytes(self.keys) + _nbytes(self.values)

    def checkpoint_bytes(self) -> int:
        return sum(_nbytes(c.residual) for c in self.calls)


class KVDirectCache(Cache):
    """A transformers ``Cache`` of ``KVDirectLayer``s sharing one hot-window policy."""

    def __init__(
        self,
        adapter: ArchAdapter,
        forms: list[str],
        hot_window: int | None = None,
    ) -> None:
        if len(forms) != adapter.num_layers:
            raise ValueError("one checkpoint form per layer is needed")
        self.adapter = adapter
        self.hot_window = hot_window
        self.stats = CacheStats()
        layers = [
            KVDirectLayer(self, spec.index, form, spec.sliding_window)
            for spec, form in zip(adapter.layers, forms)
        ]
        super().__init__(layers=layers)
        self._hooks: list[Any] = []

    # The pre-hook hands each decoder layer's input (h_l) to the matching cache layer.
    def attach(self) -> KVDirectCache:
        if self._hooks:
            return self
        for idx, module in enumerate(self.adapter.decoder_layers):
            layer = self.layers[idx]
            if layer.form != "residual":
                continue
            self._hooks.append(
                module.register_forward_pre_hook(_capture_into(layer), with_kwargs=True)
            )
        return self

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def __enter__(self) -> KVDirectCache:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- accounting ----------------------------------------------------------------------
    def hot_bytes(self) -> int:
        return sum(layer.hot_bytes() for layer in self.layers)

    def checkpoint_bytes(self) -> int:
        return sum(layer.checkpoint_bytes() for layer in self.layers)

    def hot_tokens(self) -> int:
        """Tokens whose K/V are held at every residual-form full-attention layer."""
        lengths = [
            layer.hot_length
            for layer in self.layers
            if layer.form == "residual" and not layer.is_sliding
        ]
        if not lengths:
            lengths = [layer.hot_length for layer in self.layers]
        return min(lengths) if lengths else 0


def _capture_into(layer: KVDirectLayer):
    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        layer.pending_residual = hidden

    return hook
