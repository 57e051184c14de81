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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvchat.engine.disk_tier import DiskRows, RowFile, SpillArea, read_rows
from kvchat.engine.planner import READ_CHUNK_ROWS
from kvchat.errors import NeedsDiskTierError, StorageError

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
    """Residual rows of one original forward call at one layer: in memory or on disk."""

    start: int
    residual: torch.Tensor | None  # [1, M, d] while resident
    disk: DiskRows | None = None  # where the rows are once they left memory
    saved: DiskRows | None = None  # the same rows in a saved segment, once saved

    @property
    def rows(self) -> int:
        held = self.residual if self.residual is not None else self.disk
        return held.shape[1]

    @property
    def end(self) -> int:
        return self.start + self.rows

    @property
    def resident_bytes(self) -> int:
        return _nbytes(self.residual)


def _split_call(call: _Call, rows: int) -> list[_Call]:
    if call.rows <= rows:
        return [call]
    pieces = []
    for r0 in range(0, call.rows, rows):
        r1 = min(call.rows, r0 + rows)
        if call.residual is not None:
            pieces.append(_Call(call.start + r0, call.residual[:, r0:r1]))
            continue
        disk = call.disk
        row_bytes = disk.nbytes // disk.shape[1]
        shape = (1, r1 - r0, disk.shape[-1])
        part = DiskRows(disk.file, disk.offset + r0 * row_bytes, shape, disk.dtype)
        pieces.append(_Call(call.start + r0, None, disk=part))
    return pieces


@dataclass
class CacheStats:
    """Counters the accounting snapshot reads."""

    recompute_seconds: float = 0.0
    recomputed_tokens: int = 0
    scratch_peak_bytes: int = 0
    step_scratch_bytes: int = 0  # largest scratch since the last forward call began
    spilled_bytes: int = 0  # checkpoint bytes moved to disk (cumulative)
    disk_read_bytes: int = 0  # checkpoint bytes read back from disk (cumulative)

    def note_scratch(self, nbytes: int) -> None:
        self.scratch_peak_bytes = max(self.scratch_peak_bytes, nbytes)
        self.step_scratch_bytes = max(self.step_scratch_bytes, nbytes)


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
        # Cold positions [begin, end) left for the streamed attention to fetch (disk tier).
        self.pending_cold: tuple[int, int] | None = None

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
        self.pending_cold = None
        if self.form == "residual" and visible_from < hot_from:
            if self.owner.stream_chunk is not None:
                # Too big to hold at once: attention fetches it chunk by chunk (see
                # streamed_attention.py); we hand over only what is hot.
                self.pending_cold = (visible_from, hot_from)
                self.owner.adapter._attention(self.layer_idx)._kvdirect_layer = self
            else:
                cold_k, cold_v = self._recompute(visible_from, hot_from)
                parts_k.append(cold_k)
                parts_v.append(cold_v)
        skip = max(0, visible_from - hot_from)  # hot tokens a sliding layer can no longer see
        hot_k, hot_v = self.keys[..., skip:, :], self.values[..., skip:, :]
        full_k = torch.cat([*parts_k, hot_k, key_states], dim=-2)
        full_v = torch.cat([*parts_v, hot_v, value_states], dim=-2)
        if parts_k:
            scratch = _nbytes(full_k) + _nbytes(full_v) + sum(map(_nbytes, parts_k + parts_v))
            self.owner.stats.note_scratch(scratch)

        self.cumulative_length = start + new_len
        if not parts_k and skip == 0 and self._keep_hot() >= full_k.shape[-2]:
            # Nothing leaves the window: what attention gets is the new cache, as in
            # DynamicLayer (a second concatenation cost ~10% of decode time at 2K-8K).
            self.keys, self.values = full_k, full_v
        else:
            self._retain(hot_k, hot_v, key_states, value_states)
        if self.form == "residual":
            # After _retain, so a sliding layer never writes out rows it is about to drop.
            self._keep_under_budget()
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
            if self.pending_cold is not None:  # streamed attention still has to read them
                needed_from = min(needed_from, self.pending_cold[0])
            self.calls = [c for c in self.calls if c.end > needed_from]

    def _recompute(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions [begin, end), replayed call by call (see module docstring)."""
        pieces = list(self.iter_cold_kv(begin, end, self.owner.stream_chunk or READ_CHUNK_ROWS))
        cold_k = torch.cat([k for k, _ in pieces], dim=-2)
        cold_v = torch.cat([v for _, v in pieces], dim=-2)
        return cold_k, cold_v

    def iter_cold_kv(
        self, begin: int, end: int, chunk_rows: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """K/V of positions [begin, end) in order, a bounded chunk of calls at a time.

        Each chunk holds whole calls (a call is replayed with its original row count, which
        is what keeps the recomputed K/V bit-identical) and at most ``chunk_rows`` rows
        unless a single call is longer. Rows on disk are read just before their chunk.
        """
        calls = [c for c in self.calls if c.end > begin and c.start < end]
        if chunk_rows is not None and self.owner.stream_chunk is not None:
            # Streamed attention bounds scratch by rows, so a long call (a prefill chunk
            # saved under a roomier ceiling) is projected in pieces: last-bit differences
            # are possible here, which this path's promise (same greedy tokens) allows.
            calls = [
                piece
                for c in calls
                for piece in _split_call(c, chunk_rows)
                if piece.end > begin and piece.start < end
            ]
        stats = self.owner.stats
        i = 0
        while i < len(calls):
            j, rows = i + 1, calls[i].rows
            while chunk_rows is not None and j < len(calls) and rows + calls[j].rows <= chunk_rows:
                rows += calls[j].rows
                j += 1
            if chunk_rows is None:
                j = len(calls)
            t0 = time.perf_counter()
            with torch.no_grad():
                residuals = self._load(calls[i:j])
                pieces = self._replay(calls[i:j], residuals, begin, end)
            stats.recompute_seconds += time.perf_counter() - t0
            stats.recomputed_tokens += sum(k.shape[-2] for k, _ in pieces)
            yield from pieces
            i = j

    def _load(self, calls: list[_Call]) -> list[torch.Tensor]:
        """The residual rows of ``calls``, reading those on disk (adjacent runs at once)."""
        on_disk = [c.disk for c in calls if c.residual is None]
        device = getattr(self, "device", None) or "cpu"
        loaded = iter(read_rows(on_disk, device) if on_disk else [])
        self.owner.stats.disk_read_bytes += sum(d.nbytes for d in on_disk)
        return [c.residual if c.residual is not None else next(loaded) for c in calls]

    def _replay(
        self, calls: list[_Call], residuals: list[torch.Tensor], begin: int, end: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Recompute ``calls`` (whose rows are ``residuals``), clipped to [begin, end).

        Consecutive one-row calls (decoded tokens) are grouped: their norm, k-norm and RoPE
        run once over the group (row-independent), while the projection still runs one row
        per call, as it originally did.
        """
        adapter = self.owner.adapter
        idx = self.layer_idx
        pieces = []
        i = 0
        while i < len(calls):
            j = i
            if calls[i].rows == 1:
                while (
                    j + 1 < len(calls)
                    and calls[j + 1].rows == 1
                    and calls[j + 1].start == calls[j].end
                ):
                    j += 1
            group = calls[i : j + 1]
            if len(group) == 1:
                hidden = residuals[i]
                key, value = adapter.project(idx, adapter.normalize(idx, hidden))
            else:
                hidden = torch.cat(residuals[i : j + 1], dim=1)
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
        """Checkpoint bytes resident in memory (rows moved to disk are not counted here)."""
        return sum(c.resident_bytes for c in self.calls)

    def disk_checkpoint_bytes(self) -> int:
        return sum(c.disk.nbytes for c in self.calls if c.residual is None)

    # -- disk tier -----------------------------------------------------------------------
    def _keep_under_budget(self) -> None:
        """Move the oldest resident checkpoints to disk while over this layer's budget."""
        budget = self.owner.layer_checkpoint_budget(self)
        if budget is None:
            return
        excess = self.checkpoint_bytes() - budget
        if excess <= 0:
            return
        moving, freed = [], 0
        for call in self.calls:
            if call.residual is None:
                continue
            moving.append(call)
            freed += call.resident_bytes
            if freed >= excess:
                break
        unsaved = [c for c in moving if c.saved is None]
        if unsaved:
            rows = torch.cat([c.residual for c in unsaved], dim=1)
            try:
                where = self.owner.spill_area().write(self.layer_idx, rows)
            except StorageError as exc:
                # Never fail inside a forward call (the layers would disagree on what they
                # hold): stay over budget for this call, and refuse the next one cleanly.
                self.owner.spill_error = exc
                return
            offset = where.offset
            for call in unsaved:
                shape = tuple(call.residual.shape)
                call.disk = DiskRows(where.file, offset, shape, where.dtype)
                offset += call.resident_bytes
            self.owner.stats.spilled_bytes += sum(c.resident_bytes for c in unsaved)
        for call in moving:
            if call.saved is not None:
                call.disk = call.saved  # already in a segment: nothing to write
            call.residual = None

    def trim_hot(self) -> None:
        """Drop hot K/V beyond the current window now, not at this layer's next update."""
        if self.form != "residual" or self.keys is None:
            return
        keep = self._keep_hot()
        if self.keys.shape[-2] > keep:
            cut = self.keys.shape[-2] - keep
            self.keys = _compact(self.keys[..., cut:, :])
            self.values = _compact(self.values[..., cut:, :])

    def load_resident(self) -> None:
        """Bring every checkpoint on disk back into memory (the ceiling allows it now)."""
        on_disk = [c for c in self.calls if c.residual is None]
        for call, rows in zip(on_disk, self._load(on_disk)):
            call.residual = rows.clone() if rows.device.type == "cpu" else rows
            if call.saved is None:
                call.disk = None


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
        # Disk tier (set by the planner under a ceiling): resident checkpoint bytes allowed
        # across residual layers, and the chunk size of streamed attention (None: hand
        # attention the whole K/V, the bit-identical path).
        self.checkpoint_budget: int | None = None
        self.stream_chunk: int | None = None
        self.spill_root: Path | None = None
        self._spill: SpillArea | None = None
        self._row_files: dict[str, RowFile] = {}
        self._attention_patch: Any = None
        self.spill_error: StorageError | None = None  # a failed move to disk, reported next call
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
        self.enable_streaming(self.stream_chunk)  # re-attached: streaming needs its patch
        return self

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._attention_patch is not None:
            self._attention_patch.remove()
            self._attention_patch = None

    def enable_streaming(self, chunk: int | None) -> None:
        """Stream cold K/V into attention ``chunk`` rows at a time (None: off)."""
        self.stream_chunk = chunk
        if chunk is not None and self._attention_patch is None:
            from kvchat.engine.streamed_attention import StreamedAttention

            self._attention_patch = StreamedAttention(self)

    # -- disk tier -----------------------------------------------------------------------
    def layer_checkpoint_budget(self, layer: KVDirectLayer) -> int | None:
        """``layer``'s share of the resident checkpoint budget, by the tokens it must keep:
        a sliding layer needs at most a window, a full layer the whole conversation."""
        if self.checkpoint_budget is None:
            return None

        def need(x: KVDirectLayer) -> int:
            if x.is_sliding:
                return min(x.cumulative_length, x.sliding_window)
            return x.cumulative_length

        total = sum(need(x) for x in self.layers if x.form == "residual")
        return self.checkpoint_budget * need(layer) // max(total, 1)

    def spill_area(self) -> SpillArea:
        if self._spill is None:
            if self.spill_root is None:
                from kvchat.paths import data_dir

                self.spill_root = data_dir()
            self._spill = SpillArea(self.spill_root)
        return self._spill

    def row_file(self, path: Path) -> RowFile:
        """A saved segment opened for reading rows back (one descriptor per file)."""
        key = str(path)
        if key not in self._row_files:
            self._row_files[key] = RowFile(path)
        return self._row_files[key]

    def apply_plan(self, plan: Any) -> None:
        """Take the planner's hot window and disk tier, and meet them before the next call."""
        self.hot_window = plan.hot_window
        if self.spill_error is not None:
            error, self.spill_error = self.spill_error, None
            raise NeedsDiskTierError(f"{error}; the conversation so far is kept") from error
        self.checkpoint_budget = plan.checkpoint_budget
        self.enable_streaming(plan.stream_chunk)
        for layer in self.layers:
            if layer.form == "residual":
                layer.trim_hot()
                layer._keep_under_budget()
        self.stats.step_scratch_bytes = 0

    def disk_bytes(self) -> int:
        """Bytes of spill files (saved segments are counted by the conversation)."""
        return 0 if self._spill is None else self._spill.nbytes()

    def close(self) -> None:
        self.detach()
        if self._spill is not None:
            self._spill.close()
            self._spill = None
        for file in self._row_files.values():
            file.close()
        self._row_files.clear()

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
