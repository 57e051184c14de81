"""Reading a layer's cold rows back as K/V: from memory or disk, K/V pieces as they are,
residual pieces replayed through the layer's projections.

A residual piece is replayed with the row count of the forward call that made it (the
model's matmuls are not batch invariant, so other row counts would change the K/V in the
last bits); consecutive one-row pieces share their row-independent steps, and consecutive
pieces of any size share one projection call where the layer's projections are
row-independent (torch's int8 kernel, kvchat's int4 kernel). K/V pieces on disk are read
straight into attention's token-major buffer where they can be (CPU, the model's dtype),
or in fixed windows counted from the first visible position when attention is streamed,
so the sum runs in the same order however the rows were stored.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from kvchat.engine.kvdirect.planner import READ_CHUNK_ROWS
from kvchat.engine.kvdirect.state_store import Piece, RowStore, unpack_kv
from kvchat.threads import rows_threads


class CacheLayer(Protocol):
    """What the reader uses of a cache layer (``cache.KVDirectLayer``)."""

    store: RowStore  # the layer's cold rows
    owner: Any  # its KVDirectCache: adapter, stats, stream_chunk, scratch, prefetch
    layer_idx: int
    kv_heads: int
    head_dim: int


class ColdReader:
    """The cold-row reads of one cache layer (its store, shapes and device, and the owning
    cache's scratch buffers, statistics and prefetch)."""

    def __init__(self, layer: CacheLayer) -> None:
        self.layer = layer

    def kv(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions [begin, end) from the store: residual pieces replayed call by
        call (see module docstring), K/V pieces read as they are."""
        pieces = list(self.iter_kv(begin, end, READ_CHUNK_ROWS))
        cold_k = torch.cat([k for k, _ in pieces], dim=-2)
        cold_v = torch.cat([v for _, v in pieces], dim=-2)
        return cold_k, cold_v

    def iter_kv(
        self, begin: int, end: int, chunk_rows: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """K/V of positions [begin, end) in order, a bounded run of pieces at a time.

        Each run holds whole pieces (a residual piece is replayed with its original row
        count, which is what keeps the recomputed K/V bit-identical) and at most
        ``chunk_rows`` rows unless a single piece is longer. Under streamed attention a
        longer K/V piece is read in ``chunk_rows`` parts; a longer residual piece is still
        replayed whole (one forward call's rows), since projecting it in parts would change
        its K/V in the last bits.
        """
        layer = self.layer
        pieces = layer.store.pieces_in(begin, end)
        streamed = chunk_rows is not None and layer.owner.stream_chunk is not None
        stats = layer.owner.stats
        device = getattr(layer, "device", None) or "cpu"
        if pieces and all(p.form == "kv" for p in pieces):
            if streamed:
                yield from self._kv_windows(pieces, device, begin, end, chunk_rows)
                return
            chunk_rows = None  # K/V rows: one read per run of adjacent pieces, no replay
            scratch = layer.owner.scratch.read_buffer
        else:
            scratch = None
        i = 0
        while i < len(pieces):
            j, rows = i + 1, pieces[i].rows
            while (
                chunk_rows is not None and j < len(pieces) and rows + pieces[j].rows <= chunk_rows
            ):
                rows += pieces[j].rows
                j += 1
            if chunk_rows is None:
                j = len(pieces)
            run = pieces[i:j]
            t0 = time.perf_counter()
            with torch.no_grad():
                if streamed and len(run) == 1 and run[0].rows > chunk_rows and run[0].form == "kv":
                    out = self._in_parts(run[0], device, begin, end, chunk_rows)
                else:
                    out = self._to_kv(run, layer.store.load(run, device, scratch), begin, end)
                stats.disk_read_bytes += layer.store.read_bytes(run)
            if any(p.form == "residual" for p in run):
                stats.recompute_seconds += time.perf_counter() - t0
                stats.recomputed_tokens += sum(k.shape[-2] for k, _ in out)
            else:
                stats.read_seconds += time.perf_counter() - t0
            yield from out
            i = j

    def in_place_pieces(self, begin: int, end: int, key_states: torch.Tensor) -> list[Piece]:
        """The pieces of cold rows [begin, end) if they can be read straight into
        attention's buffer (all K/V rows of the model's dtype, on CPU; see
        ``_token_major``), else none."""
        layer = self.layer
        if key_states.device.type != "cpu":
            return []
        pieces = layer.store.pieces_in(begin, end)
        if all(p.form == "kv" and p.dtype == key_states.dtype for p in pieces):
            return pieces
        return []

    def token_major(
        self,
        pieces: list[Piece],
        begin: int,
        end: int,
        after: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the cold positions [begin, end) (held by ``pieces``) followed by the
        ``after`` K/V pairs (none: the cold rows alone), as views of a token-major buffer
        (one of two, by layer): the stored rows are read into it as they lie on disk, so
        nothing regathers them; the attention kernel takes the strided views and gives
        bit-identical results (tests/engine/kvdirect/test_tiers.py). Whole pieces are read,
        so a piece that starts before ``begin`` leads the buffer."""
        layer = self.layer
        lead = begin - pieces[0].start
        stored = pieces[-1].end - pieces[0].start
        tail = sum(k.shape[-2] for k, _ in after)
        heads, dim = layer.kv_heads, layer.head_dim
        dtype = pieces[0].dtype  # the model's: in_place_pieces checked it
        rows = max(stored, lead + end - begin) + tail
        width = 2 * heads * dim
        stats = layer.owner.stats
        t0 = time.perf_counter()
        flat = layer.owner.take_prefetched(layer.layer_idx, pieces, rows * width)
        if flat is None:
            flat = layer.owner.scratch.rows_buffer(rows * width, dtype, layer.layer_idx % 2)
            layer.store.read_into(pieces, flat[: stored * width].view(torch.uint8))
        stats.read_seconds += time.perf_counter() - t0
        stats.disk_read_bytes += layer.store.read_bytes(pieces)
        stats.rows_read_in_place += stored
        # While this layer computes, the next one's cold rows come in on the other core.
        new_rows = after[-1][0].shape[-2] if after else 1
        layer.owner.prefetch(layer.layer_idx + 1, dtype, key_states_rows=new_rows)
        stats.note_scratch(layer.owner.scratch.rows_buffers_bytes())  # this and the next
        both = flat[: rows * width].view(1, rows, 2, heads, dim)
        at = lead + (end - begin)
        for k, v in after:
            n = k.shape[-2]
            both[:, at : at + n, 0].copy_(k.transpose(1, 2))
            both[:, at : at + n, 1].copy_(v.transpose(1, 2))
            at += n
        visible = both[:, lead:at]
        return visible[:, :, 0].transpose(1, 2), visible[:, :, 1].transpose(1, 2)

    def _kv_windows(
        self, pieces: list[Piece], device: torch.device, begin: int, end: int, chunk_rows: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """K/V pieces in windows of ``chunk_rows`` positions counted from ``begin``,
        whatever the pieces' own boundaries: streamed attention then sums in the same
        order however the rows were spilled, saved or resumed."""
        layer = self.layer
        stats = layer.owner.stats
        t0 = time.perf_counter()
        windows = layer.store.load_windows(
            pieces, begin, end, chunk_rows, layer.owner.scratch.window_buffer
        )
        for _, rows in windows:
            stats.read_seconds += time.perf_counter() - t0
            k, v = unpack_kv(rows.to(device), layer.kv_heads, layer.head_dim)
            yield k, v
            t0 = time.perf_counter()
        stats.disk_read_bytes += layer.store.read_bytes(pieces)

    def _in_parts(
        self, piece: Piece, device: torch.device, begin: int, end: int, chunk_rows: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        layer = self.layer
        out = []
        cuts = list(range(chunk_rows, piece.rows, chunk_rows))
        for r0, rows in layer.store.load_in_parts(piece, device, cuts):
            a = piece.start + r0
            b = a + rows.shape[1]
            if b <= begin or a >= end:
                continue
            part = Piece(a, piece.form, rows, calls=[b - a])
            out.extend(self._to_kv([part], [rows], begin, end))
        return out

    def _to_kv(
        self, pieces: list[Piece], rows: list[torch.Tensor], begin: int, end: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K/V of ``pieces`` (whose rows are ``rows``), clipped to [begin, end).

        Consecutive residual pieces are grouped where that changes no bit: their norm,
        k-norm and RoPE run once over the group (row-independent). The projection runs once
        over the group too where the layer's projections are row-independent
        (``ArchAdapter.projects_rows_independently``); otherwise only one-row pieces
        (decoded tokens) are grouped, and the projection still runs one row per call, as it
        originally did.
        """
        layer = self.layer
        adapter = layer.owner.adapter
        idx = layer.layer_idx
        any_rows = adapter.projects_rows_independently(idx)
        out = []
        i = 0
        while i < len(pieces):
            first, stop = pieces[i].start, pieces[i].end
            if pieces[i].form == "kv":
                k, v = unpack_kv(rows[i], layer.kv_heads, layer.head_dim)
                i += 1
            else:
                j = i
                if any_rows or pieces[i].rows == 1:
                    while (
                        j + 1 < len(pieces)
                        and pieces[j + 1].form == "residual"
                        and (any_rows or pieces[j + 1].rows == 1)
                        and pieces[j + 1].start == pieces[j].end
                    ):
                        j += 1
                group = pieces[i : j + 1]
                stop = group[-1].end
                hidden = rows[i] if len(group) == 1 else torch.cat(rows[i : j + 1], dim=1)
                if len(group) == 1 or any_rows:
                    # One call: the original call's rows on its thread count (the count can
                    # change the bits), or rows the layer projects independently of it.
                    with rows_threads(hidden.shape[1]):
                        key, value = adapter.project(idx, adapter.normalize(idx, hidden))
                else:
                    normed = adapter.normalize(idx, hidden)
                    with rows_threads(1):
                        parts = [
                            adapter.project(idx, normed[:, r : r + 1]) for r in range(len(group))
                        ]
                    key = torch.cat([k for k, _ in parts], dim=1)
                    value = torch.cat([v for _, v in parts], dim=1)
                positions = torch.arange(first, stop, device=hidden.device).unsqueeze(0)
                k, v = layer.owner.held(*adapter.finish(idx, key, value, hidden, positions))
                i = j + 1
            lo, hi = max(begin, first) - first, min(end, stop) - first
            out.append((k[..., lo:hi, :], v[..., lo:hi, :]))
        return out
