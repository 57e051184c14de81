"""A cache's state in a conversation's segment files: what a save writes, how the saved
rows are bound back to the cache, and how a cache is rebuilt from them.

The caches call these through their own methods (``state``, ``bind_saved``,
``restore``), so whoever orchestrates a save or a resume never asks which kind of cache
it holds. Per turn a segment holds, for every layer, only what that turn added since the
last save, as the layer's state store reports it (``RowStore.state``):

* residual pieces: ``L{i}.residual`` (the residual rows of this turn's forward calls,
  concatenated) and ``L{i}.calls`` (the row count of each call), because the replay that
  makes recompute bit-identical needs the original call boundaries; ``L{i}.first``;
* K/V-form layers: ``L{i}.kv``, the K/V rows packed token-major (``pack_kv``: cold rows
  the store holds, then the hot ones), so any run of positions is one byte range that the
  disk tier reads back in place; ``L{i}.kvfirst``;
* the standard cache: ``L{i}.k`` / ``L{i}.v`` and ``L{i}.first`` (also what K/V-form layers
  wrote before the packed form; still read).

Hot K/V of residual layers are never saved: on resume they are recomputed from the
checkpoints by the same replay, which gives the same bits. Saved pieces keep their form
(a residual piece is replayed, a K/V piece read); new tokens take the form chosen now.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvchat.engine.kvdirect.interface import SavedSegment
from kvchat.engine.kvdirect.state_store import MAX_PIECE_ROWS, Piece, PieceState, pack_kv

if TYPE_CHECKING:
    from transformers.cache_utils import CacheLayerMixin

    from kvchat.engine.kvdirect.disk_tier import DiskRows
    from kvchat.storage.segments import StreamedTensor, TensorLocation

READ_ROWS = 256  # rows streamed into a segment (or out of the store) per run

# The caches call in here (cache.py, standard.py), so they are not imported: ``cache`` is
# a KVDirectCache or a StandardCache, ``layer`` a KVDirectLayer, as each function says.
KVDirectCache = StandardCache = KVDirectLayer = Any


# -- KV-Direct -------------------------------------------------------------------------------
def _save_plan(cache: KVDirectCache, since: int) -> list[dict[str, Any]]:
    """Per layer, what a save from position ``since`` writes, in order: the residual
    pieces, and the K/V pieces plus the hot K/V rows (K/V-form layers)."""
    out = []
    for i, layer in enumerate(cache.layers):
        pieces = [p for _, p in layer.store.state(since)]
        residual = [p for p in pieces if p.form == "residual"]
        kv = [p for p in pieces if p.form == "kv"]
        hot_from = None
        if layer.form == "kv" and layer.hot_length:
            hot_from = max(since, layer.hot_from)
            if hot_from >= layer.cumulative_length:
                hot_from = None
        if kv and hot_from is not None and kv[-1].end != hot_from:
            raise RuntimeError(f"layer {i}: K/V rows to save are not contiguous")
        out.append(
            {"index": i, "layer": layer, "residual": residual, "kv": kv, "hot_from": hot_from}
        )
    return out


def kv_direct_state(cache: KVDirectCache, since: int) -> dict[str, torch.Tensor | StreamedTensor]:
    """What the cache gained at positions >= ``since``, for a segment file. Rows are
    streamed into the segment a bounded run at a time, never gathered in memory whole."""
    out: dict[str, torch.Tensor | StreamedTensor] = {}
    for entry in _save_plan(cache, since):
        i, layer = entry["index"], entry["layer"]
        if entry["residual"]:
            calls = entry["residual"]
            out[f"L{i}.residual"] = _streamed(layer, calls, None)
            out[f"L{i}.calls"] = torch.tensor([c.rows for c in calls])
            out[f"L{i}.first"] = torch.tensor([calls[0].start])
        if entry["kv"] or entry["hot_from"] is not None:
            out[f"L{i}.kv"] = _streamed(layer, entry["kv"], entry["hot_from"])
            first = entry["kv"][0].start if entry["kv"] else entry["hot_from"]
            out[f"L{i}.kvfirst"] = torch.tensor([first])
    return out


def _streamed(layer: KVDirectLayer, pieces: list[Piece], hot_from: int | None) -> StreamedTensor:
    """The rows of ``pieces`` then (K/V form) the hot rows from ``hot_from``, as one tensor
    streamed in bounded runs."""
    from kvchat.engine.kvdirect.disk_tier import tensor_view
    from kvchat.storage.segments import StreamedTensor

    rows = sum(p.rows for p in pieces)
    if pieces:
        width, dtype = pieces[0].width, pieces[0].dtype
    else:
        width, dtype = 2 * layer.kv_heads * layer.head_dim, layer.keys.dtype
    hot_rows = 0 if hot_from is None else layer.cumulative_length - hot_from

    def chunks() -> Iterator[memoryview]:
        yield from layer.store.stream(pieces, READ_ROWS)
        if hot_rows:
            skip = hot_from - layer.hot_from
            for r0 in range(skip, layer.hot_length, READ_ROWS):
                r1 = min(layer.hot_length, r0 + READ_ROWS)
                packed = pack_kv(layer.keys[..., r0:r1, :], layer.values[..., r0:r1, :])
                yield tensor_view(packed.detach().to("cpu").contiguous())

    return StreamedTensor(dtype, (1, rows + hot_rows, width), chunks)


def kv_direct_bind(
    cache: KVDirectCache, layout: dict[str, TensorLocation], path: Path, since: int
) -> None:
    """After a save from ``since`` wrote a segment at ``path`` with tensors at ``layout``:
    point each saved piece at its rows there, so the disk tier reads them from the segment
    (and never writes them again), and remember where the hot K/V rows were saved. Spill
    files go empty only when no piece still needs them."""
    for entry in _save_plan(cache, since):
        i, layer = entry["index"], entry["layer"]
        if entry["residual"] and f"L{i}.residual" in layout:
            calls = entry["residual"]
            where = _segment_rows(cache, layout[f"L{i}.residual"], path, [c.rows for c in calls])
            layer.store.bind_saved(calls, where)
        if f"L{i}.kv" in layout:
            lengths = [p.rows for p in entry["kv"]]
            hot_rows = 0
            if entry["hot_from"] is not None:
                hot_rows = layer.cumulative_length - entry["hot_from"]
            where = _segment_rows(cache, layout[f"L{i}.kv"], path, [*lengths, hot_rows])
            layer.store.bind_saved(entry["kv"], where[: len(lengths)])
            if hot_rows:
                layer.saved_hot.append((entry["hot_from"], layer.cumulative_length, where[-1]))
    if cache.spill is not None and cache.spill_bytes_live() == 0:
        cache.spill.empty()


def _segment_rows(
    cache: KVDirectCache, where: TensorLocation, path: Path, lengths: list[int]
) -> list[DiskRows]:
    """Where runs of ``lengths`` rows sit, one after another, in tensor ``where`` of a segment."""
    from kvchat.engine.kvdirect.disk_tier import DiskRows

    file = cache.row_file(path)
    offset = where.offset
    width = where.shape[-1]
    row_bytes = width * torch.empty((), dtype=where.dtype).element_size()
    out = []
    for n in lengths:
        out.append(DiskRows(file, offset, (1, n, width), where.dtype))
        offset += n * row_bytes
    return out


def kv_direct_from_state(
    cache: KVDirectCache, segments: Iterable[SavedSegment], n_cached: int, device: torch.device
) -> None:
    """Rebuild ``cache`` (on ``device``) from saved segments, in turn order.

    Saved pieces are not loaded: each points at its rows in the segment file, and the disk
    tier reads them when needed (or all at once when the ceiling allows). Then each layer's
    hot window is rebuilt from them (the same replay, the same bits)."""
    for segment in segments:
        layout, path = segment.layout, segment.path
        small = _small_tensors(path, layout)
        old_kv = None
        for i, layer in enumerate(cache.layers):
            layer.device = device  # where rows read back from disk must go
            if f"L{i}.residual" in layout:
                lengths = small[f"L{i}.calls"].tolist()
                first = int(small[f"L{i}.first"][0])
                where = _segment_rows(cache, layout[f"L{i}.residual"], path, lengths)
                starts = list(itertools.accumulate([first, *lengths[:-1]]))
                entries = [
                    (PieceState(s, n, "residual", [n]), w)
                    for s, n, w in zip(starts, lengths, where)
                ]
                _extend_store(layer, entries)
            if f"L{i}.kv" in layout:
                first = int(small[f"L{i}.kvfirst"][0])
                total = layout[f"L{i}.kv"].shape[1]
                lengths = [min(MAX_PIECE_ROWS, total - r) for r in range(0, total, MAX_PIECE_ROWS)]
                where = _segment_rows(cache, layout[f"L{i}.kv"], path, lengths)
                starts = list(itertools.accumulate([first, *lengths[:-1]]))
                entries = [
                    (PieceState(s, n, "kv", None), w) for s, n, w in zip(starts, lengths, where)
                ]
                _extend_store(layer, entries)
            if f"L{i}.k" in layout:  # written before K/V rows were packed: load them
                if old_kv is None:
                    old_kv = segment.read_tensors()
                first = int(small[f"L{i}.first"][0])
                rows = pack_kv(old_kv[f"L{i}.k"], old_kv[f"L{i}.v"]).to(device)
                layer.store.take(first)
                layer.store.append(Piece(first, "kv", rows))
    for layer in cache.layers:
        layer.cumulative_length = n_cached
        layer.store.take(n_cached)  # rows a later, unsaved-then-rebased state never reached
        if layer.is_sliding:
            layer.store.drop_before(max(0, n_cached - layer.sliding_window + 1))
        _restore_hot(layer, n_cached)
        if cache.checkpoint_budget is None and layer.form == "residual":
            layer.load_resident()
        layer.keep_under_budget()


def _extend_store(layer: KVDirectLayer, entries: list[tuple[PieceState, DiskRows]]) -> None:
    """Add saved pieces after what the store holds (a later turn's rows replace a
    rebased turn's from the same position on)."""
    if not entries:
        return
    layer.store.take(entries[0][0].start)
    layer.store.from_state(entries)


def _small_tensors(path: Path, layout: dict[str, TensorLocation]) -> dict[str, torch.Tensor]:
    """The per-layer ``.first`` / ``.calls`` index tensors, read by offset (the segment was
    verified when its layout was read). Not through ``safe_open``: with torch loaded it maps
    the whole file and costs tens of MiB of RSS for a few bytes."""
    from kvchat.engine.kvdirect.disk_tier import DiskRows, RowFile, read_rows

    names = [n for n in layout if n.endswith((".first", ".calls", ".kvfirst"))]
    file = RowFile(path)
    parts = [DiskRows(file, layout[n].offset, layout[n].shape, layout[n].dtype) for n in names]
    return dict(zip(names, read_rows(parts, "cpu")))


def _restore_hot(layer: KVDirectLayer, n_cached: int) -> None:
    """The hot window's K/V from the saved pieces (replayed or read: the same bits). A
    K/V-form layer's hot rows leave its store (the store holds only what is cold); where
    they were saved as K/V, that is remembered so they are never written out again.
    Residual rows leave the store only whole calls at a time (replayed with their own row
    count), so the window may start earlier: the rows before it go out again as K/V."""
    store = layer.store
    if store.start is None:
        return
    keep = min(layer.keep_hot(), n_cached - store.start)
    if keep <= 0:
        return
    begin = n_cached - keep
    if layer.form == "kv":
        begin = store.call_start(begin)
    keys, values = layer.cold_kv(begin, n_cached)
    layer.set_hot(keys, values)
    if layer.form == "kv":
        for piece in store.take(begin):
            if piece.form == "kv" and piece.saved is not None:
                layer.saved_hot.append((piece.start, piece.end, piece.saved))
        layer.trim_hot()


# -- the standard cache -----------------------------------------------------------------------
def standard_state(cache: StandardCache, since: int) -> dict[str, torch.Tensor]:
    """The K/V rows at positions >= ``since`` that each layer holds."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        if layer.keys is None or layer.keys.shape[-2] == 0:
            continue
        end = cache.get_seq_length()
        held_from = end - layer.keys.shape[-2]
        first = max(since, held_from)
        if first >= end:
            continue
        out[f"L{i}.k"] = layer.keys[..., first - held_from :, :].contiguous().cpu()
        out[f"L{i}.v"] = layer.values[..., first - held_from :, :].contiguous().cpu()
        out[f"L{i}.first"] = torch.tensor([first])
    return out


def standard_from_state(
    cache: StandardCache, segments: Iterable[SavedSegment], n_cached: int, device: torch.device
) -> None:
    """Load the saved K/V rows turn by turn; ValueError for a conversation that holds
    KV-Direct state (its rows are not all there to load)."""
    parts: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for segment in segments:
        layout = segment.layout
        if not any(name.endswith(".k") for name in layout):
            if any(name.endswith((".residual", ".kv")) for name in layout):
                raise ValueError(
                    "this conversation holds K/V-Direct state: resume it with --cache kvdirect"
                )
            continue
        tensors = segment.read_tensors()
        for i in range(len(cache.layers)):
            if f"L{i}.k" in tensors:
                first = int(tensors[f"L{i}.first"][0])
                k, v = tensors[f"L{i}.k"].to(device), tensors[f"L{i}.v"].to(device)
                parts.setdefault(i, []).append((first, k, v))
    for i, layer in enumerate(cache.layers):
        if parts.get(i):
            _restore_kv(layer, parts[i], n_cached)
        layer.cumulative_length = n_cached


def _restore_kv(
    layer: CacheLayerMixin, parts: list[tuple[int, torch.Tensor, torch.Tensor]], n_cached: int
) -> None:
    """K/V rows saved turn by turn; keep the contiguous run ending at ``n_cached``."""
    run = len(parts) - 1
    while run > 0 and parts[run - 1][0] + parts[run - 1][1].shape[-2] == parts[run][0]:
        run -= 1
    keys = torch.cat([k for _, k, _ in parts[run:]], dim=-2)
    values = torch.cat([v for _, _, v in parts[run:]], dim=-2)
    keep = keys.shape[-2]
    if getattr(layer, "is_sliding", False):
        keep = min(keep, layer.sliding_window - 1)
    layer.lazy_initialization(keys, values)
    layer.keys = keys[..., keys.shape[-2] - keep :, :].contiguous()
    layer.values = values[..., values.shape[-2] - keep :, :].contiguous()
