"""A conversation's state on disk: what each turn adds, and how to rebuild the cache from it.

Per turn the segment file holds, for every layer, only what that turn added since the last
save, as the layer's state store reports it (``RowStore.state``):

* residual pieces: ``L{i}.residual`` (the residual rows of this turn's forward calls,
  concatenated) and ``L{i}.calls`` (the row count of each call), because the replay that
  makes recompute bit-identical needs the original call boundaries; ``L{i}.first``;
* K/V-form layers: ``L{i}.kv``, the K/V rows packed token-major (cache.pack_kv: cold rows
  the store holds, then the hot ones), so any run of positions is one byte range that the
  disk tier reads back in place; ``L{i}.kvfirst``;
* the standard cache: ``L{i}.k`` / ``L{i}.v`` and ``L{i}.first`` (also what K/V-form layers
  wrote before the packed form; still read).

Hot K/V of residual layers are never saved: on resume they are recomputed from the
checkpoints by the same replay, which gives the same bits. A conversation resumes under any
ceiling and any ``--checkpoint``: saved pieces keep their form (a residual piece is
replayed, a K/V piece read), new tokens take the form chosen now. The manifest (storage) holds
messages, token ids, the model fingerprint and dtype; ``engine_state`` holds the template
text the token ids stand for and the per-layer forms.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvchat.engine.kvdirect.cache import MAX_PIECE_ROWS, KVDirectCache, KVDirectLayer, pack_kv
from kvchat.engine.kvdirect.state_store import Piece, PieceState

if TYPE_CHECKING:
    from transformers import DynamicCache
    from transformers.cache_utils import CacheLayerMixin

    from kvchat.engine.kvdirect.disk_tier import DiskRows
    from kvchat.storage import Conversation, Turn
    from kvchat.storage.segments import StreamedTensor, TensorLocation


def _save_plan(cache: KVDirectCache, since: int) -> list[dict[str, Any]]:
    """Per K/V-Direct layer, what a save from position ``since`` writes, in order: the
    residual pieces, and the K/V pieces plus the hot K/V rows (K/V-form layers)."""
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


def turn_tensors(
    cache: KVDirectCache | DynamicCache, since: int
) -> dict[str, torch.Tensor | StreamedTensor]:
    """What the cache gained at positions >= ``since``, for a segment file.

    Rows are streamed into the segment (``StreamedTensor``) a bounded run at a time, never
    gathered in memory whole: rows on disk are read back, resident ones copied per run.
    """
    out: dict[str, torch.Tensor | StreamedTensor] = {}
    if not isinstance(cache, KVDirectCache):
        return _standard_tensors(cache, since)
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


def _standard_tensors(cache: DynamicCache, since: int) -> dict[str, torch.Tensor]:
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


READ_ROWS = 256


def encode_calls(calls: list[int]) -> list[list[int]]:
    """Forward-call sizes as runs ``[[rows, count], ...]`` (a reply's decode steps are one
    run of ones), for a turn's manifest record."""
    runs: list[list[int]] = []
    for rows in calls:
        if runs and runs[-1][0] == rows:
            runs[-1][1] += 1
        else:
            runs.append([rows, 1])
    return runs


def decode_calls(runs: Any, rows: int) -> list[int]:
    """The sizes :func:`encode_calls` wrote, which must add up to ``rows``; ValueError if
    ``runs`` is not such a list (checked before expanding: a hostile count stays a number)."""
    if not isinstance(runs, list) or not all(
        isinstance(run, list) and len(run) == 2 and all(type(x) is int and x > 0 for x in run)
        for run in runs
    ):
        raise ValueError("its forward calls are not a list of [rows, count] pairs")
    total = sum(size * count for size, count in runs)
    if total != rows:
        raise ValueError(f"its forward calls add up to {total} positions, not {rows}")
    return [size for size, count in runs for _ in range(count)]


def note_saved(
    cache: KVDirectCache | DynamicCache, conversation: Conversation, turn_index: int, since: int
) -> None:
    """After a save: point each saved piece at its rows in the segment, so the disk tier
    reads them from there (and never writes them again), and remember where the hot K/V
    rows were saved. Spill files go empty only when no piece still needs them (a save
    whose re-pointing failed leaves its rows in the spill files, which are then kept)."""
    if not isinstance(cache, KVDirectCache):
        return
    path = conversation.segment_path(turn_index)
    bind_segment(cache, conversation.tensor_layout(turn_index), path, since)


def bind_segment(
    cache: KVDirectCache | DynamicCache,
    layout: dict[str, TensorLocation],
    path: Path,
    since: int,
) -> None:
    """:func:`note_saved` for a segment written at ``path`` with tensors at ``layout``
    (what a save from ``since`` wrote), whichever conversation file it is. The standard
    cache keeps nothing on disk: nothing to re-point."""
    if not isinstance(cache, KVDirectCache):
        return
    for entry in _save_plan(cache, since):
        i, layer = entry["index"], entry["layer"]
        if entry["residual"] and f"L{i}.residual" in layout:
            calls = entry["residual"]
            where = segment_rows(cache, layout[f"L{i}.residual"], path, [c.rows for c in calls])
            layer.store.bind_saved(calls, where)
        if f"L{i}.kv" in layout:
            lengths = [p.rows for p in entry["kv"]]
            hot_rows = 0
            if entry["hot_from"] is not None:
                hot_rows = layer.cumulative_length - entry["hot_from"]
            where = segment_rows(cache, layout[f"L{i}.kv"], path, [*lengths, hot_rows])
            layer.store.bind_saved(entry["kv"], where[: len(lengths)])
            if hot_rows:
                layer.saved_hot.append((entry["hot_from"], layer.cumulative_length, where[-1]))
    if cache.spill is not None and cache.spill_bytes_live() == 0:
        cache.spill.empty()


def segment_rows(
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


def restore(
    cache: KVDirectCache | DynamicCache,
    conversation: Conversation,
    n_cached: int,
    device: torch.device,
) -> None:
    """Rebuild ``cache`` (on ``device``) from the saved segments, in turn order.

    Saved pieces are not loaded: each points at its rows in the segment file, and the
    disk tier reads them when needed (or all at once when the ceiling allows). Then each
    layer's hot window is rebuilt from them (the same replay, the same bits). The standard
    cache loads its tensors.
    """
    if not isinstance(cache, KVDirectCache):
        _restore_standard(cache, conversation, n_cached, device)
        return
    for turn in turns_from_last_rebase(conversation):
        layout = conversation.tensor_layout(turn.index)
        path = conversation.segment_path(turn.index)
        small = _small_tensors(conversation, turn.index, layout)
        old_kv = None
        for i, layer in enumerate(cache.layers):
            layer.device = device  # where rows read back from disk must go
            if f"L{i}.residual" in layout:
                lengths = small[f"L{i}.calls"].tolist()
                first = int(small[f"L{i}.first"][0])
                where = segment_rows(cache, layout[f"L{i}.residual"], path, lengths)
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
                where = segment_rows(cache, layout[f"L{i}.kv"], path, lengths)
                starts = list(itertools.accumulate([first, *lengths[:-1]]))
                entries = [
                    (PieceState(s, n, "kv", None), w) for s, n, w in zip(starts, lengths, where)
                ]
                _extend_store(layer, entries)
            if f"L{i}.k" in layout:  # written before K/V rows were packed: load them
                if old_kv is None:
                    old_kv = conversation.read_turn_tensors(turn.index)
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


def turns_from_last_rebase(conversation: Conversation) -> list[Turn]:
    """The turns whose segments make up the state: from the last rebase turn on."""
    turns = conversation.manifest.turns
    rebased = [t.index for t in turns if t.extra.get("rebase")]
    return turns[rebased[-1] - 1 :] if rebased else turns


def _extend_store(layer: KVDirectLayer, entries: list[tuple[PieceState, DiskRows]]) -> None:
    """Add saved pieces after what the store holds (a later turn's rows replace a
    rebased turn's from the same position on)."""
    if not entries:
        return
    layer.store.take(entries[0][0].start)
    layer.store.from_state(entries)


def _small_tensors(
    conversation: Conversation, index: int, layout: dict[str, TensorLocation]
) -> dict[str, torch.Tensor]:
    """The per-layer ``.first`` / ``.calls`` index tensors, read by offset (the segment was
    verified when its layout was read). Not through ``safe_open``: with torch loaded it maps
    the whole file and costs tens of MiB of RSS for a few bytes."""
    from kvchat.engine.kvdirect.disk_tier import DiskRows, RowFile, read_rows

    names = [n for n in layout if n.endswith((".first", ".calls", ".kvfirst"))]
    file = RowFile(conversation.segment_path(index))
    parts = [DiskRows(file, layout[n].offset, layout[n].shape, layout[n].dtype) for n in names]
    return dict(zip(names, read_rows(parts, "cpu")))


def _restore_standard(
    cache: DynamicCache, conversation: Conversation, n_cached: int, device: torch.device
) -> None:
    parts: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for turn in turns_from_last_rebase(conversation):
        layout = conversation.tensor_layout(turn.index)
        if not any(name.endswith(".k") for name in layout):
            if any(name.endswith((".residual", ".kv")) for name in layout):
                raise ValueError(
                    "this conversation holds K/V-Direct state: resume it with --cache kvdirect"
                )
            continue
        tensors = conversation.read_turn_tensors(turn.index)
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


def _restore_hot(layer: KVDirectLayer, n_cached: int) -> None:
    """The hot window's K/V from the saved pieces (replayed or read: the same bits). A
    K/V-form layer's hot rows leave its store (the store holds only what is cold); where
    they were saved as K/V, that is remembered so they are never written out again."""
    store = layer.store
    if store.start is None:
        return
    keep = min(layer.keep_hot(), n_cached - store.start)
    if keep <= 0:
        return
    begin = n_cached - keep
    keys, values = layer.cold_kv(begin, n_cached)
    layer.set_hot(keys, values)
    if layer.form == "kv":
        for piece in store.take(begin):
            if piece.form == "kv" and piece.saved is not None:
                layer.saved_hot.append((piece.start, piece.end, piece.saved))
