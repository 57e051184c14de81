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
same inputs, same bits. ``tests/engine/kvdirect/test_cache_exact.py`` checks ``torch.equal`` against
``DynamicCache`` per layer, in fp32 and bf16, for every family.

The price is that each decoded token that has left the hot window costs one small GEMV per
layer per step when it is recomputed; prefill chunks cost one GEMM each. The benchmarks
measure it.

Where rows live
---------------
Each layer's cold rows sit in a ``RowStore`` (state_store.py) as pieces of either form --
the residual (recomputed, as above) or the K/V themselves (read back, bit for bit) -- and in
one of three places: resident, a spill file, or a saved segment. A layer has a *capture*
form, what its new tokens become: residual layers checkpoint every token's residual as it
passes (hot tokens too, since the residual exists only during the forward call); K/V-form
layers write a token's K/V out only when it leaves the hot window, so with nothing evicted
a K/V-form layer holds exactly what ``DynamicCache`` holds. A store may mix forms (a
conversation saved as residuals and resumed as K/V keeps its old pieces as they are).

How K/V-form rows reach attention
--------------------------------
While one layer's whole K/V fits in scratch, stored K/V rows are read (on CPU) straight into
a token-major buffer, the hot window and the new rows copied in behind them, and attention
gets strided head-major views of it: kvchat's attention kernel reads rows by stride, so the
same bits as for contiguous K/V, and nothing is regathered. Two such buffers alternate by
layer, so the next layer's rows are read in the background while a layer computes. Below
that, attention is streamed window by window (streamed_attention.py).

Sliding-window layers (Gemma 3, Mistral) return exactly what ``DynamicSlidingWindowLayer``
returns (the last ``window - 1`` tokens plus the new ones) and drop a call's residuals once
none of its rows can be seen again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvchat.engine.kvdirect.attention import route
from kvchat.engine.kvdirect.cold_reader import ColdReader
from kvchat.engine.kvdirect.disk_tier import DiskRows, RowFile, SpillArea
from kvchat.engine.kvdirect.interface import CallLog
from kvchat.engine.kvdirect.planner import READ_CHUNK_ROWS
from kvchat.engine.kvdirect.scratch import ScratchBuffers
from kvchat.engine.kvdirect.state_store import (
    MAX_PIECE_ROWS,
    Piece,
    RowStore,
    nbytes,
    pack_kv,
    sub_rows,
)
from kvchat.errors import NeedsDiskTierError, StorageError

if TYPE_CHECKING:
    from kvchat.engine.kvdirect.arch import ArchAdapter
    from kvchat.engine.kvdirect.interface import CacheAccounting, SavedSegment
    from kvchat.engine.kvdirect.planner import Plan, Planner

CHECKPOINT_FORMS = ("residual", "kv", "auto")
# The same for sliding layers, whose pieces go as the window moves past their last row:
# smaller pieces free their spill space sooner (a file then holds about one window).
SLIDING_PIECE_ROWS = 32


def _rows(
    spans: list[tuple[torch.Tensor, torch.Tensor]], start: int, stop: int
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Rows ``[start, stop)`` of the K/V in ``spans`` laid end to end, and whether they are
    a view (they lie in one span) rather than a new tensor (joined across spans)."""
    keys, values = [], []
    offset = 0
    for k, v in spans:
        lo, hi = max(start - offset, 0), min(stop - offset, k.shape[-2])
        if lo < hi or (not keys and offset + k.shape[-2] >= stop):
            keys.append(k[..., lo:hi, :])
            values.append(v[..., lo:hi, :])
        offset += k.shape[-2]
    if len(keys) == 1:
        return keys[0], values[0], True
    return torch.cat(keys, dim=-2), torch.cat(values, dim=-2), False


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` in storage of its own size, so a kept slice never pins a whole chunk's tensor."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == nbytes(t):
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


class _Growth(NamedTuple):
    """Storage a hot window grows in: the hot rows are ``keys``/``values``, views of
    ``key_rows``/``value_rows`` from row ``first``."""

    key_rows: torch.Tensor
    value_rows: torch.Tensor
    first: int
    keys: torch.Tensor
    values: torch.Tensor


class CacheStats:
    """Counters the accounting snapshot reads."""

    def __init__(self) -> None:
        self.recompute_seconds = 0.0
        self.recomputed_tokens = 0
        self.read_seconds = 0.0  # reading K/V-form rows back from disk
        self.scratch_peak_bytes = 0
        self.step_scratch_bytes = 0  # largest scratch since the last forward call began
        self.spilled_bytes = 0  # bytes moved to disk (cumulative)
        self.disk_read_bytes = 0  # bytes read back from disk (cumulative)
        self.rows_read_in_place = 0  # cold rows read straight into attention's buffer

    def note_scratch(self, n: int) -> None:
        self.scratch_peak_bytes = max(self.scratch_peak_bytes, n)
        self.step_scratch_bytes = max(self.step_scratch_bytes, n)


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
        self.form = form  # what new tokens leave behind
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.cumulative_length = 0
        self.store = RowStore(
            layer_idx, max_piece_rows=SLIDING_PIECE_ROWS if self.is_sliding else MAX_PIECE_ROWS
        )
        self.kv_heads, self.head_dim = owner.adapter.kv_shape(layer_idx)
        self.cold = ColdReader(self)  # reads the store's rows back as K/V
        self.pending_residual: torch.Tensor | None = None
        # Cold positions [begin, end) left for the streamed attention to fetch (disk tier).
        self.pending_cold: tuple[int, int] | None = None
        # Cold K/V already read into attention's buffer for this call, handed over with
        # pending_cold so attention folds it before the hot rows, which stay where they are.
        self.held_cold: tuple[torch.Tensor, torch.Tensor] | None = None
        # K/V leaving the hot window while streamed attention still reads cold rows that
        # die with this call: written out once it has (finish_streamed), into their space.
        self.pending_write: tuple[torch.Tensor, torch.Tensor, int] | None = None
        # K/V-form rows already in a saved segment while still hot: (start, end, where).
        # When they leave the hot window they point there instead of being written again.
        self.saved_hot: list[tuple[int, int, DiskRows]] = []
        # (keys, values) storage with room for hot_reserve more rows, of which
        # self.keys / self.values are the leading views; None while the window is compact.
        self.growth: _Growth | None = None

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

    def attended_range(self) -> tuple[int, int]:
        """(first position the next call attends to, first hot position): the cold rows
        the next call needs are the positions between."""
        start = self.cumulative_length
        visible_from = 0 if not self.is_sliding else max(0, start - self.sliding_window + 1)
        return visible_from, start - self.hot_length

    @property
    def hot_from(self) -> int:
        return self.cumulative_length - self.hot_length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key_states, value_states = self.owner.held(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending_write is not None:
            self.finish_streamed()  # the last call's attention never came back for it
        start = self.cumulative_length
        new_len = key_states.shape[-2]
        if self.form == "residual":
            residual = self.pending_residual
            if residual is None or residual.shape[1] != new_len:
                raise RuntimeError(
                    f"layer {self.layer_idx}: no residual captured for this call; "
                    "was the cache attached to the model (KVDirectCache.attach)?"
                )
            self.store.append(Piece(start, "residual", _compact(residual), calls=[new_len]))
            self.pending_residual = None

        # Positions attention needs now: everything (full layer) or the last window - 1
        # past tokens (sliding layer), exactly as the standard cache returns them.
        visible_from, hot_from = self.attended_range()
        parts_k, parts_v = [], []
        in_place: list[Piece] = []  # cold pieces read straight into attention's buffer
        self.pending_cold = self.held_cold = None
        if visible_from < hot_from:
            if self.owner.stream_chunk is not None:
                # Too big to hold at once: attention fetches it chunk by chunk (see
                # streamed_attention.py); we hand over only what is hot.
                from kvchat.engine.kvdirect.attention import installed, set_pending_stream

                module = self.owner.adapter.attention_module(self.layer_idx)
                if not installed(module.config):
                    # The model's own attention would see only the hot K/V: refuse loudly
                    # (someone called set_attn_implementation on the shared model).
                    raise RuntimeError(
                        f"layer {self.layer_idx}: streamed attention is not installed "
                        f"(attention implementation "
                        f"{module.config._attn_implementation!r}); the cold K/V would be skipped"
                    )
                self.pending_cold = (visible_from, hot_from)
                set_pending_stream(self)
            else:
                in_place = self.cold.in_place_pieces(visible_from, hot_from, key_states)
                if in_place and self._steps_in_reserve(new_len):
                    return self._update_apart(
                        in_place, visible_from, hot_from, key_states, value_states
                    )
                cold = (
                    [] if in_place else self.iter_cold_kv(visible_from, hot_from, READ_CHUNK_ROWS)
                )
                for cold_k, cold_v in cold:
                    parts_k.append(cold_k)
                    parts_v.append(cold_v)
        skip = max(0, visible_from - hot_from)  # hot tokens a sliding layer can no longer see
        if not (in_place or parts_k or self.pending_cold) and self._grows(visible_from, hot_from):
            self.cumulative_length = start + new_len
            room = new_len + self.owner.hot_reserve
            full_k, full_v = self._append_hot(key_states, value_states, skip, room)
            self._settle_window()
            return full_k, full_v
        hot_k, hot_v = self.keys[..., skip:, :], self.values[..., skip:, :]
        if in_place:
            full_k, full_v = self.cold.token_major(
                in_place, visible_from, hot_from, [(hot_k, hot_v), (key_states, value_states)]
            )
        elif parts_k:
            # Into buffers reused by every layer and step: attention reads them before the
            # next layer's update refills them, and the hot window is copied out below.
            full_k = self.owner.scratch.kv_buffer("k", [*parts_k, hot_k, key_states])
            full_v = self.owner.scratch.kv_buffer("v", [*parts_v, hot_v, value_states])
        else:
            full_k = torch.cat([hot_k, key_states], dim=-2)
            full_v = torch.cat([hot_v, value_states], dim=-2)
        if parts_k:
            held = {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in parts_k + parts_v
            }
            scratch = nbytes(full_k) + nbytes(full_v) + sum(held.values())
            self.owner.stats.note_scratch(scratch)
        had_cold = bool(in_place or parts_k)
        del parts_k, parts_v

        self.cumulative_length = start + new_len
        if not had_cold and skip == 0 and self.keep_hot() >= full_k.shape[-2]:
            # Nothing leaves the window: what attention gets is the new cache, as in
            # DynamicLayer (a second concatenation cost ~10% of decode time at 2K-8K).
            self._hold(full_k, full_v)
        elif self.owner.stream_chunk is None:
            self._retain([(full_k, full_v)], visible_from, hot_from)
        else:
            self._retain([(hot_k, hot_v), (key_states, value_states)], hot_from + skip, hot_from)
        self.keep_under_budget()
        return full_k, full_v

    def _steps_in_reserve(self, new_len: int) -> bool:
        """Whether this call's rows go behind a K/V-form window in its reserve (disk tier,
        whole K/V read in place), attention folding the cold rows and the window apart."""
        reserve = self.owner.kv_reserve
        return self.form == "kv" and 0 < new_len <= reserve and self._window() is not None

    def _update_apart(
        self,
        pieces: list[Piece],
        visible_from: int,
        hot_from: int,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cold rows [visible_from, hot_from) read into attention's buffer and handed
        over apart (``held_cold``); the new rows appended behind the hot window in its
        reserve, and the rows that leave the window written out. Attention folds the cold
        rows, then the window: the exact kernel folds keys one by one, so the bits are those
        of one call over all of them, and neither the window nor the new rows are copied
        into the buffer and back out at every step."""
        from kvchat.engine.kvdirect.attention import set_pending_stream

        self.held_cold = self.cold.token_major(pieces, visible_from, hot_from, [])
        self.pending_cold = (visible_from, hot_from)
        set_pending_stream(self)
        self.cumulative_length += key_states.shape[-2]
        # New storage holds the window, then the step's row and the reserve the plan counts.
        room = max(key_states.shape[-2], 1 + self.owner.kv_reserve)
        full_k, full_v = self._append_hot(key_states, value_states, 0, room)
        lo = max(hot_from, self._needed_from())
        if lo < self.hot_from:
            rows = slice(lo - hot_from, self.hot_from - hot_from)
            self._write_out(full_k[..., rows, :], full_v[..., rows, :], lo)
        self._settle_window()
        self.keep_under_budget()
        return full_k, full_v

    def cold_chunks(
        self, begin: int, end: int, chunk_rows: int | None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """What attention folds before the hot rows: the cold K/V this call's update read
        already, else positions [begin, end) read ``chunk_rows`` at a time."""
        held, self.held_cold = self.held_cold, None
        if held is not None:
            return iter([held])
        return self.iter_cold_kv(begin, end, chunk_rows)

    def join_held(
        self, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The held cold K/V followed by ``key``/``value``, as one tensor each: for an
        attention that cannot fold them apart (not kvchat's exact kernel)."""
        (cold_k, cold_v), self.held_cold = self.held_cold, None
        self.pending_cold = None
        return torch.cat([cold_k, key], dim=-2), torch.cat([cold_v, value], dim=-2)

    # -- the hot window ------------------------------------------------------------------
    def _settle_window(self) -> None:
        """After the hot window moved: a sliding layer's pieces go once no row of them can
        be seen again by a later query, and saved rows now cold stop counting as hot."""
        if self.is_sliding:
            self.store.drop_before(self._needed_from())
        self._forget_saved_below(self.hot_from)

    def _hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make ``keys``/``values`` the hot rows, letting go of any grown storage."""
        self.keys, self.values = keys, values
        self.growth = None

    def _window(self) -> int | None:
        """The hot window this layer's form follows (None: every token)."""
        return self.owner.kv_window if self.form == "kv" else self.owner.hot_window

    def _live_growth(self) -> _Growth | None:
        """The grown storage, if the hot rows are still the views it handed out (resume or
        a trim may have set the window since); else None."""
        grown = self.growth
        if grown is None or self.keys is not grown.keys or self.values is not grown.values:
            return None
        return grown

    def _grows(self, visible_from: int, hot_from: int) -> bool:
        """Whether the hot rows are all this call needs and nothing leaves them for the
        store: no window of the cache's own, and every visible row hot (a full layer keeps
        every token; a sliding layer's rows that leave its window are dead)."""
        if self.owner.hot_reserve <= 0 or self._window() is not None:
            return False
        return visible_from >= hot_from if self.is_sliding else hot_from == 0

    def _append_hot(
        self, key_states: torch.Tensor, value_states: torch.Tensor, skip: int, room: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the new rows behind the hot ones (from ``skip``), in the reserve when it has
        room (new storage has ``room`` rows behind the hot ones); returns what attention
        reads (the hot rows from ``skip``, then the new), and keeps the last ``keep_hot()``
        of them as the hot window. A window that keeps a bounded number of rows (sliding,
        or under the disk tier) moves along the reserve; when the reserve is used up, the
        rows still needed move to fresh storage with a new reserve behind them.

        Attention gets views of the grown storage: the same values in the same order as a
        concatenation, read by stride, so the same bits.
        """
        n, new_len = self.hot_length, key_states.shape[-2]
        grown = self._live_growth()
        if grown is not None and grown.first + n + new_len <= grown.key_rows.shape[-2]:
            keys, values, first = grown.key_rows, grown.value_rows, grown.first
        else:
            rows = n - skip + room
            keys = key_states.new_empty((*key_states.shape[:2], rows, key_states.shape[-1]))
            values = value_states.new_empty((*value_states.shape[:2], rows, value_states.shape[-1]))
            keys[..., : n - skip, :].copy_(self.keys[..., skip:, :])
            values[..., : n - skip, :].copy_(self.values[..., skip:, :])
            first = -skip  # where the dropped rows would have been
        end = first + n + new_len
        keys[..., end - new_len : end, :].copy_(key_states)
        values[..., end - new_len : end, :].copy_(value_states)
        keep = min(self.keep_hot(), end - first - skip)
        self.keys = keys[..., end - keep : end, :]
        self.values = values[..., end - keep : end, :]
        self.growth = _Growth(keys, values, end - keep, self.keys, self.values)
        return keys[..., first + skip : end, :], values[..., first + skip : end, :]

    def release_reserve(self) -> None:
        """Hold the hot rows in storage of their own size (between replies)."""
        if self.growth is not None:
            self._hold(_compact(self.keys), _compact(self.values))

    def keep_hot(self) -> int:
        """How many of the most recent tokens keep their K/V after this step."""
        window = self._window()
        keep = self.cumulative_length if window is None else window
        if self.is_sliding:
            keep = min(keep, self.sliding_window - 1)
        return keep

    def _needed_from(self) -> int:
        """The first position a later query can still see."""
        if not self.is_sliding:
            return 0
        needed = self.cumulative_length - self.sliding_window + 1
        if self.pending_cold is not None:  # streamed attention still has to read them
            needed = min(needed, self.pending_cold[0])
        return max(0, needed)

    def _retain(
        self,
        spans: list[tuple[torch.Tensor, torch.Tensor]],
        first: int,
        hot_from: int,
    ) -> None:
        """Keep the last ``keep_hot()`` of the rows in ``spans`` (consecutive positions from
        ``first`` up to the cache's end; hot before this call from ``hot_from``) as the hot
        window, and write out the K/V-form rows that leave it and are still needed. Spans
        are what attention got (one tensor), or the hot window and the new rows when cold
        K/V is streamed (two, so they are not concatenated whole)."""
        n = sum(k.shape[-2] for k, _ in spans)
        keep = max(0, min(self.keep_hot(), n))
        end = self.cumulative_length
        if self.form == "kv":
            lo = max(first, hot_from, self._needed_from())
            if lo < end - keep:
                k, v, view = _rows(spans, lo - first, end - keep - first)
                if self.pending_cold is not None and self.is_sliding:
                    # Streamed attention still reads this layer's cold rows: write after,
                    # from rows of their own.
                    self.pending_write = (k.clone(), v.clone(), lo) if view else (k, v, lo)
                else:
                    self._write_out(k, v, lo)
        k, v, view = _rows(spans, n - keep, n)
        # A view may be of a buffer every layer reuses, or pin a whole chunk: copy it.
        self._hold(*((k.clone(), v.clone()) if view else (k, v)))
        self._settle_window()

    def finish_streamed(self) -> None:
        """Streamed attention has read this call's cold rows: drop those no later query can
        see, then write out the rows that left the hot window, into the space just freed."""
        self.store.drop_before(self._needed_from())
        if self.pending_write is not None:
            keys, values, first = self.pending_write
            self.pending_write = None
            self._write_out(keys, values, first)

    def _forget_saved_below(self, position: int) -> None:
        while self.saved_hot and self.saved_hot[0][1] <= position:
            self.saved_hot.pop(0)

    def _write_out(self, keys: torch.Tensor, values: torch.Tensor, first: int) -> None:
        """K/V of positions [first, first + n) leave the hot window: onto disk, as K/V."""
        self.store.drop_before(self._needed_from())
        rows = pack_kv(keys, values)
        n = rows.shape[1]
        at = 0
        while at < n:
            pos = first + at
            self._forget_saved_below(pos)
            saved = next(((s, e, w) for s, e, w in self.saved_hot[:2] if s <= pos < e), None)
            if saved is not None:
                s, e, where = saved
                take = min(n - at, e - pos)
                piece = Piece(pos, "kv", _compact(rows[:, at : at + take]))
                piece.saved = sub_rows(where, pos - s, pos - s + take)
            else:
                nxt = min([s for s, _, _ in self.saved_hot[:2] if s > pos], default=first + n)
                take = min(n - at, nxt - pos, self.store.max_piece_rows)
                piece = Piece(pos, "kv", _compact(rows[:, at : at + take]))
            self._store_piece(piece)
            at += take

    def _store_piece(self, piece: Piece) -> None:
        try:
            self.store.write_out(piece, self.owner.spill_area())
            self.owner.stats.spilled_bytes += 0 if piece.saved is not None else piece.disk.nbytes
        except StorageError as exc:
            # Never fail inside a forward call (the layers would disagree on what they
            # hold): keep the rows resident, and refuse the next call cleanly.
            self.owner.spill_error = exc
            self.store.append(piece)

    def trim_hot(self) -> None:
        """Drop hot K/V beyond the current window now, not at this layer's next update."""
        if self.keys is None:
            return
        keep = self.keep_hot()
        if self.keys.shape[-2] > keep:
            cut = self.keys.shape[-2] - keep
            if self.form == "kv":
                lo = max(0, self._needed_from() - self.hot_from)
                if lo < cut:
                    self._write_out(
                        self.keys[..., lo:cut, :], self.values[..., lo:cut, :], self.hot_from + lo
                    )
            self._hold(_compact(self.keys[..., cut:, :]), _compact(self.values[..., cut:, :]))
            self._forget_saved_below(self.hot_from)
        elif self._window() is not None and not self.owner.kv_reserve:
            self.release_reserve()  # the plan no longer counts a reserve

    # -- reading cold rows ---------------------------------------------------------------
    def cold_kv(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions [begin, end) from the store, joined (see ``ColdReader``)."""
        return self.cold.kv(begin, end)

    def iter_cold_kv(
        self, begin: int, end: int, chunk_rows: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """K/V of positions [begin, end) in order, a bounded run at a time (``ColdReader``)."""
        return self.cold.iter_kv(begin, end, chunk_rows)

    # -- accounting ----------------------------------------------------------------------
    def hot_bytes(self) -> int:
        """Bytes the hot window holds, its reserve included."""
        grown = self._live_growth()
        if grown is not None:
            return nbytes(grown.key_rows) + nbytes(grown.value_rows)
        return nbytes(self.keys) + nbytes(self.values)

    def checkpoint_bytes(self) -> int:
        """Checkpoint bytes resident in memory (rows on disk are not counted here)."""
        return self.store.resident_bytes

    def disk_checkpoint_bytes(self) -> int:
        return self.store.disk_bytes

    # -- the disk tier -------------------------------------------------------------------
    def keep_under_budget(self) -> None:
        """Move the oldest resident checkpoints to disk while over this layer's budget."""
        budget = self.owner.layer_checkpoint_budget(self)
        if budget is None:
            return
        excess = self.store.resident_bytes - budget
        if excess <= 0:
            return
        try:
            self.owner.stats.spilled_bytes += self.store.move_out(excess, self.owner.spill_area())
        except StorageError as exc:
            # Never fail inside a forward call: stay over budget, refuse the next call.
            self.owner.spill_error = exc

    def load_resident(self) -> None:
        """Bring every checkpoint on disk back into memory (the ceiling allows it now)."""
        self.store.load_resident(getattr(self, "device", None) or "cpu")

    def set_hot(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The hot window's K/V, as rebuilt on resume (the last ``keys.shape[-2]`` tokens)."""
        self.lazy_initialization(keys, values)
        self._hold(_compact(keys), _compact(values))


class KVDirectCache(Cache):
    """A transformers ``Cache`` of ``KVDirectLayer``s sharing one hot-window policy."""

    def __init__(
        self,
        adapter: ArchAdapter,
        forms: list[str],
        hot_window: int | None = None,
        planner: Planner | None = None,
        *,
        kv_dtype: str | None = None,
    ) -> None:
        """``kv_dtype``: hold K/V in this dtype (``--kv-dtype``) rather than as the model
        computes them. Each row is rounded once, where it enters (``update``) or is
        recomputed from a residual checkpoint, so every path holds the same bits."""
        if len(forms) != adapter.num_layers:
            raise ValueError("one checkpoint form per layer is needed")
        self.adapter = adapter
        self.kv_dtype = None if kv_dtype is None else getattr(torch, kv_dtype)
        self.hot_window = hot_window  # residual-form layers
        # The planner fits windows and the disk tier under a ceiling before each forward
        # call (prepare); an explicit hot window caps what it picks. Without one, the
        # windows stay as given (the lab's studies set them by hand).
        self.planner = planner
        self.hot_window_cap = hot_window
        self.plan: Plan | None = None  # the plan in force
        self.calls = CallLog()
        self.kv_window: int | None = None  # K/V-form layers (set under the disk tier)
        # Rows each growing hot window may hold ahead (the plan's hot_reserve, which the
        # planner counts; set by hand where there is no planner). 0 keeps it compact.
        self.hot_reserve = 0
        self.kv_reserve = 0  # the same for K/V-form windows under the disk tier (Plan)
        self.stats = CacheStats()
        # Disk tier (set by the planner under a ceiling): resident checkpoint bytes allowed
        # across residual layers, and the chunk size of streamed attention (None: hand
        # attention the whole K/V, the bit-identical path).
        self.checkpoint_budget: int | None = None
        self.stream_chunk: int | None = None
        self.decode_stream_chunk: int | None = None  # the same for one-token steps
        self.spill_root: Path | None = None
        self.spill: SpillArea | None = None
        self._row_files: dict[str, RowFile] = {}
        self._budget_need_total = 0
        self.scratch = ScratchBuffers()  # reused by every layer and step
        self.spill_error: StorageError | None = None  # a failed move to disk, reported next call
        self._prefetched: tuple[int, list[int], int, torch.Tensor, Future] | None = None
        layers = [
            KVDirectLayer(self, spec.index, form, spec.sliding_window)
            for spec, form in zip(adapter.layers, forms)
        ]
        super().__init__(layers=layers)
        self._hooks: list[Any] = []

    # Residual capture has one way in, note_layer_input: the model's forward reaches it
    # through a pre-hook on each residual-form decoder layer, a decode step that runs the
    # layers' work itself (kvchat.engine.models.decode_step) calls it directly.
    def attach(self) -> KVDirectCache:
        if self._hooks:
            return self
        for idx, module in enumerate(self.adapter.decoder_layers):
            layer = self.layers[idx]
            if layer.form != "residual":
                continue
            self._hooks.append(
                module.register_forward_pre_hook(_capture_into(self, idx), with_kwargs=True)
            )
        route(self.adapter.model, self.adapter)
        return self

    def held(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V as this cache holds them (in ``kv_dtype``, where one is set)."""
        if self.kv_dtype is None or keys.dtype == self.kv_dtype:
            return keys, values
        return keys.to(self.kv_dtype), values.to(self.kv_dtype)

    def note_layer_input(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """Decoder layer ``layer_idx`` is about to read ``hidden`` (h_l): a residual-form
        layer keeps it as the checkpoint of this call's rows."""
        if self._hooks:
            layer = self.layers[layer_idx]
            if layer.form == "residual":
                layer.pending_residual = hidden

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def enable_streaming(self, chunk: int | None) -> None:
        """Stream cold K/V into attention ``chunk`` rows at a time (None: off)."""
        self.stream_chunk = chunk
        if chunk is not None:
            route(self.adapter.model, self.adapter)

    # -- reading the next layer's cold rows ahead ----------------------------------------
    def prefetch(self, layer_idx: int, dtype: torch.dtype, key_states_rows: int) -> None:
        """Start reading layer ``layer_idx``'s cold K/V rows into its buffer, as its
        ``update`` would read them in place (disk tier, whole K/V, CPU), in the background."""
        self._settle_prefetch()
        if layer_idx >= len(self.layers) or self.stream_chunk is not None:
            return
        layer = self.layers[layer_idx]
        if not layer.is_initialized or getattr(layer, "device", None) is None:
            return
        if layer.device.type != "cpu":
            return
        visible_from, hot_from = layer.attended_range()
        if visible_from >= hot_from:
            return
        pieces = layer.store.pieces_in(visible_from, hot_from)
        if not pieces or not all(p.form == "kv" and p.dtype == dtype for p in pieces):
            return
        if all(p.resident is not None for p in pieces):
            return  # nothing on disk: the copy is quick where it is
        lead = visible_from - pieces[0].start
        stored = pieces[-1].end - pieces[0].start
        rows = max(stored, lead + hot_from - visible_from) + layer.hot_length + key_states_rows
        width = 2 * layer.kv_heads * layer.head_dim
        flat = self.scratch.rows_buffer(rows * width, dtype, layer_idx % 2)
        cold = flat[: stored * width].view(torch.uint8)
        future = _prefetcher().submit(layer.store.read_into, pieces, cold)
        self._prefetched = (layer_idx, [id(p) for p in pieces], rows * width, flat, future)

    def take_prefetched(self, layer_idx: int, pieces: list[Any], numel: int) -> Any:
        """The buffer :meth:`prefetch` filled for these pieces of ``layer_idx`` (errors of
        the read raise here), or None."""
        held = self._prefetched
        if held is None:
            return None
        self._prefetched = None
        idx, ids, size, flat, future = held
        future.result()  # wait; a read error or a failed check raises here, in the call
        if idx != layer_idx or ids != [id(p) for p in pieces] or size < numel:
            return None
        return flat

    def _settle_prefetch(self) -> None:
        """Wait for a prefetch nobody took (its buffer is about to be reused)."""
        held, self._prefetched = self._prefetched, None
        if held is not None:
            held[4].exception()

    # -- disk tier -----------------------------------------------------------------------
    def layer_checkpoint_budget(self, layer: KVDirectLayer) -> int | None:
        """``layer``'s share of the resident checkpoint budget, by the tokens it must keep:
        a sliding layer needs at most a window, a full layer the whole conversation.
        K/V-form layers keep no resident checkpoints under the disk tier: their resident
        share is the hot window."""
        if self.checkpoint_budget is None:
            return None
        if layer.form == "kv":
            return 0
        total = self._budget_need_total or max(1, sum(map(_need, self.layers)))
        return self.checkpoint_budget * _need(layer) // total

    def spill_area(self) -> SpillArea:
        if self.spill is None:
            if self.spill_root is None:
                from kvchat.paths import data_dir

                self.spill_root = data_dir()
            self.spill = SpillArea(self.spill_root)
        return self.spill

    def row_file(self, path: Path) -> RowFile:
        """A saved segment opened for reading rows back (one descriptor per file)."""
        key = str(path)
        if key not in self._row_files:
            self._row_files[key] = RowFile(path)
        return self._row_files[key]

    def prepare(self, n_new: int) -> Plan | None:
        """Before a forward call of ``n_new`` tokens: plan for the state after it and meet
        the plan (windows trimmed, rows moved to disk). Raises what the planner refuses
        (NeedsDiskTierError, nothing fed yet) and a failed move to disk since the last
        call. Returns the plan in force (None: no planner, the windows as given)."""
        self.calls.note(n_new, self.resident_bytes())
        if self.planner is None:
            self._raise_spill_error()
            return None
        self._apply_plan(self._plan_for(self.get_seq_length() + n_new))
        return self.plan

    def _plan_for(self, n_tokens: int) -> Plan:
        """The planner's plan for ``n_tokens``, its hot windows capped by an explicit one."""
        import dataclasses

        plan = self.planner.plan(n_tokens)
        cap = self.hot_window_cap
        if cap is not None:
            window = cap if plan.hot_window is None else min(plan.hot_window, cap)
            kv_window = cap if plan.kv_window is None else min(plan.kv_window, cap)
            plan = dataclasses.replace(plan, hot_window=window, kv_window=kv_window)
        return plan

    def _raise_spill_error(self) -> None:
        if self.spill_error is not None:
            error, self.spill_error = self.spill_error, None
            raise NeedsDiskTierError(f"{error}; the conversation so far is kept") from error

    def _apply_plan(self, plan: Plan) -> None:
        """Take a plan's windows and disk tier, and meet them before the next call."""
        self.plan = plan
        self._raise_spill_error()
        self.hot_window = plan.hot_window
        self.kv_window = plan.kv_window
        self.kv_reserve = plan.kv_reserve
        if plan.hot_reserve < self.hot_reserve:  # the ceiling no longer holds the reserve
            self.release_reserve()
        self.hot_reserve = plan.hot_reserve
        self.checkpoint_budget = plan.checkpoint_budget
        self.enable_streaming(plan.stream_chunk)
        if not plan.disk_tier:
            self.scratch.release()
        elif plan.stream_chunk is not None:
            self.scratch.release(("read", "k", "v", "rows0", "rows1"))  # whole-K/V read-back
        else:
            self.scratch.release(("window",))  # streamed attention's
        self.decode_stream_chunk = plan.decode_stream_chunk or plan.stream_chunk
        self._budget_need_total = max(1, sum(map(_need, self.layers)))
        for layer in self.layers:
            layer.trim_hot()
            layer.keep_under_budget()
        self._budget_need_total = 0
        self.stats.step_scratch_bytes = 0

    def release_reserve(self) -> bool:
        """Give back every hot window's reserve: between replies the cache holds its rows
        and nothing more (what the standard cache holds, with no ceiling). True when there
        was a reserve to give back."""
        if not self.hot_reserve:
            return False
        for layer in self.layers:
            layer.release_reserve()
        return True

    def resident_bytes(self) -> int:
        """State held right now: hot K/V, resident checkpoints and the last forward call's
        scratch, all at the same moment (token ids are the session's)."""
        return self.hot_bytes() + self.checkpoint_bytes() + self.stats.step_scratch_bytes

    def spill_bytes_live(self) -> int:
        """Bytes of rows that only a spill file holds (nothing saved points at them)."""
        return sum(layer.store.spill_bytes for layer in self.layers)

    def disk_bytes(self) -> int:
        """Bytes of spill files (saved segments are counted by the conversation)."""
        return 0 if self.spill is None else self.spill.nbytes()

    def close(self) -> None:
        self._settle_prefetch()
        self.detach()
        self.scratch.release()
        if self.spill is not None:
            self.spill.close()
            self.spill = None
        for file in self._row_files.values():
            file.close()
        self._row_files.clear()

    # -- saving and restoring itself (the formats: saved_state.py) -----------------------
    def state(self, since: int) -> dict[str, Any]:
        """What the cache gained at positions >= ``since``, as a segment's tensors."""
        from kvchat.engine.kvdirect.saved_state import kv_direct_state

        return kv_direct_state(self, since)

    def bind_saved(self, segment: SavedSegment, since: int) -> None:
        """Point the rows a save from ``since`` wrote at ``segment``: the disk tier reads
        them from there and never writes them again."""
        from kvchat.engine.kvdirect.saved_state import kv_direct_bind

        kv_direct_bind(self, segment.layout, segment.path, since)

    def restore(
        self, segments: Iterable[SavedSegment], n_cached: int, device: torch.device
    ) -> None:
        """Rebuild the state of ``n_cached`` tokens from saved segments (``SavedSegment``s,
        in turn order): saved rows stay in their files until attention needs them."""
        from kvchat.engine.kvdirect.saved_state import kv_direct_from_state

        if self.planner is not None:
            self._apply_plan(self._plan_for(n_cached))
        kv_direct_from_state(self, segments, n_cached, device)

    def __enter__(self) -> KVDirectCache:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- accounting ----------------------------------------------------------------------
    def accounting(self) -> CacheAccounting:
        from kvchat.engine.kvdirect.interface import CacheAccounting

        return CacheAccounting(
            hot_bytes=self.hot_bytes(),
            checkpoint_bytes=self.checkpoint_bytes(),
            step_scratch_bytes=self.stats.step_scratch_bytes,
            scratch_peak_bytes=self.stats.scratch_peak_bytes,
            hot_tokens=self.hot_tokens(),
            hot_window=self.hot_window,
            recompute_seconds=self.stats.recompute_seconds,
            read_seconds=self.stats.read_seconds,
            plan="all in memory" if self.plan is None else self.plan.describe(),
        )

    def hot_bytes(self) -> int:
        return sum(layer.hot_bytes() for layer in self.layers)

    def checkpoint_bytes(self) -> int:
        return sum(layer.checkpoint_bytes() for layer in self.layers)

    def hot_tokens(self) -> int:
        """Tokens whose K/V are held at every full-attention layer."""
        lengths = [layer.hot_length for layer in self.layers if not layer.is_sliding]
        if not lengths:
            lengths = [layer.hot_length for layer in self.layers]
        return min(lengths) if lengths else 0


_PREFETCHER: ThreadPoolExecutor | None = None


def _prefetcher() -> ThreadPoolExecutor:
    """One thread that reads the next layer's rows (not disk_tier's pool, whose split reads
    a prefetched read waits on)."""
    global _PREFETCHER
    if _PREFETCHER is None:
        _PREFETCHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvchat-prefetch")
    return _PREFETCHER


def _need(layer: KVDirectLayer) -> int:
    if layer.form != "residual":
        return 0
    if layer.is_sliding:
        return min(layer.cumulative_length, layer.sliding_window)
    return layer.cumulative_length


def _capture_into(cache: KVDirectCache, layer_idx: int):
    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        cache.note_layer_input(layer_idx, args[0] if args else kwargs.get("hidden_states"))

    # A decode step that skips the module calls hands the input over itself
    # (note_layer_input); this marks the hook as one it may skip.
    hook.kvchat_layer_input = True
    return hook
