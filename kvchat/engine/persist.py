"""A conversation's state on disk: what each turn adds, and how to rebuild the cache from it.

Per turn the segment file holds, for every layer, only what that turn added since the last
save:

* residual-form layers: ``L{i}.residual`` (the residual rows of this turn's forward calls,
  concatenated) and ``L{i}.calls`` (the row count of each call), because the replay that
  makes recompute bit-identical needs the original call boundaries;
* K/V-form layers and the standard cache: ``L{i}.k`` / ``L{i}.v``;
* ``L{i}.first``: the position of the first row saved.

Hot K/V of residual layers are never saved: on resume they are recomputed from the
checkpoints by the same replay, which gives the same bits. The manifest (storage) holds
messages, token ids, the model fingerprint and dtype; ``engine_state`` holds the template
text the token ids stand for and the per-layer forms.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvchat.engine.session import ChatSession, LoadedModel

_SAMPLE = 1 << 20


def fingerprint(loaded: LoadedModel, model_dir: Path | None) -> str:
    """sha256 over the config, the weights files' headers, sizes and first/last MiB, and the
    weight quantization: enough to tell two models (or two quantizations) apart in
    milliseconds, where hashing every weight byte would cost seconds at each start."""
    digest = hashlib.sha256()
    config = loaded.model.config.to_dict()
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(loaded.weights_mode.encode())
    if model_dir is not None:
        for weights in sorted(Path(model_dir).glob("*.safetensors")):
            size = weights.stat().st_size
            digest.update(f"{weights.name}:{size}".encode())
            with open(weights, "rb") as fh:
                digest.update(fh.read(_SAMPLE))
                fh.seek(max(0, size - _SAMPLE))
                digest.update(fh.read(_SAMPLE))
    return digest.hexdigest()


def turn_tensors(cache: Any, since: int) -> dict[str, Any]:
    """What the cache gained at positions >= ``since``, for a segment file.

    Residual rows that the disk tier already moved out of memory are streamed from their
    files into the segment (``StreamedTensor``), never gathered in memory whole.
    """
    from kvchat.engine.cache import KVDirectCache

    out: dict[str, Any] = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(cache, KVDirectCache) and layer.form == "residual":
            calls = [c for c in layer.calls if c.start >= since]
            if not calls:
                continue
            out[f"L{i}.residual"] = _residual_rows(layer, calls)
            out[f"L{i}.calls"] = torch.tensor([c.rows for c in calls])
            out[f"L{i}.first"] = torch.tensor([calls[0].start])
            continue
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


def _residual_rows(layer: Any, calls: list) -> Any:
    from kvchat.engine.disk_tier import tensor_view
    from kvchat.storage.segments import StreamedTensor

    if all(c.residual is not None for c in calls) and layer.owner.checkpoint_budget is None:
        return torch.cat([c.residual for c in calls], dim=1).cpu()
    # Under a disk-tier ceiling even resident rows are streamed: a copy of the turn's rows
    # would double them in memory while the segment is written.
    first = calls[0].residual if calls[0].residual is not None else calls[0].disk
    shape = (1, sum(c.rows for c in calls), first.shape[-1])

    def chunks():
        # A bounded run of calls at a time: resident rows as they are, disk rows read back.
        i = 0
        while i < len(calls):
            j, rows = i + 1, calls[i].rows
            while j < len(calls) and rows + calls[j].rows <= READ_ROWS:
                rows += calls[j].rows
                j += 1
            for rows_tensor in layer._load(calls[i:j]):
                yield tensor_view(rows_tensor.detach().to("cpu").contiguous())
            i = j

    return StreamedTensor(first.dtype, shape, chunks)


READ_ROWS = 256


def note_saved(session: ChatSession, turn_index: int, since: int) -> None:
    """After a save: remember where each new call's rows sit in the segment, so the disk
    tier reads them from there (and never writes them again); spill files go empty."""
    from kvchat.engine.cache import KVDirectCache

    cache = session.cache
    if not isinstance(cache, KVDirectCache) or session.cache_settings.max_mem is None:
        return
    conversation = session.conversation
    layout = conversation.tensor_layout(turn_index)
    path = conversation.segment_path(turn_index)
    for i, layer in enumerate(cache.layers):
        where = layout.get(f"L{i}.residual")
        if layer.form != "residual" or where is None:
            continue
        _point_calls(cache, layer, [c for c in layer.calls if c.start >= since], where, path)
    if cache._spill is not None:
        cache._spill.empty()


def _point_calls(cache: Any, layer: Any, calls: list, where: Any, path: Path) -> None:
    """Each call's rows, saved consecutively in ``where``: read them from there now."""
    for call, rows in zip(calls, _segment_rows(cache, where, path, [c.rows for c in calls])):
        call.saved = rows
        if call.residual is None:
            call.disk = rows


def _segment_rows(cache: Any, where: Any, path: Path, lengths: list[int]) -> list[Any]:
    """Where runs of ``lengths`` rows sit, one after another, in tensor ``where`` of a segment."""
    from kvchat.engine.disk_tier import DiskRows

    file = cache.row_file(path)
    offset = where.offset
    width = where.shape[-1]
    row_bytes = width * torch.empty((), dtype=where.dtype).element_size()
    out = []
    for n in lengths:
        out.append(DiskRows(file, offset, (1, n, width), where.dtype))
        offset += n * row_bytes
    return out


def restore(session: ChatSession, conversation: Any, n_cached: int) -> None:
    """Rebuild ``session.cache`` from the saved segments, in turn order.

    Residual checkpoints are not loaded: each call points at its rows in the segment file,
    and the disk tier reads them when needed (or all at once when the ceiling allows).
    K/V-form layers and the standard cache load their tensors.
    """
    from kvchat.engine.cache import KVDirectCache, _Call

    cache = session.cache
    device = session.loaded.device
    kv_parts: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    turns = conversation.manifest.turns
    rebased = [t.index for t in turns if t.extra.get("rebase")]
    kvdirect = isinstance(cache, KVDirectCache)
    has_kv = any(not (kvdirect and layer.form == "residual") for layer in cache.layers)
    for turn in turns[rebased[-1] - 1 :] if rebased else turns:
        # Read (and so verify) a turn holding K/V first: its layout check then hits the memo.
        tensors = conversation.read_turn_tensors(turn.index) if has_kv else None
        layout = conversation.tensor_layout(turn.index)
        path = conversation.segment_path(turn.index)
        small = _small_tensors(conversation, turn.index, layout)
        for i, layer in enumerate(cache.layers):
            if f"L{i}.first" not in layout:
                continue
            first = int(small[f"L{i}.first"][0])
            if f"L{i}.residual" in layout:
                if not kvdirect or layer.form != "residual":
                    raise ValueError(f"layer {i} was saved as residuals but is not residual form")
                lengths = small[f"L{i}.calls"].tolist()
                where = _segment_rows(cache, layout[f"L{i}.residual"], path, lengths)
                starts = list(itertools.accumulate([first, *lengths[:-1]]))
                layer.calls.extend(
                    _Call(start, None, disk=rows, saved=rows) for start, rows in zip(starts, where)
                )
                layer.device = device  # where rows read back from disk must go
            else:
                k = tensors[f"L{i}.k"].to(device)
                v = tensors[f"L{i}.v"].to(device)
                kv_parts.setdefault(i, []).append((first, k, v))

    disk_tier = kvdirect and cache.checkpoint_budget is not None
    for i, layer in enumerate(cache.layers):
        parts = kv_parts.get(i)
        if parts:
            _restore_kv(layer, parts, n_cached)
        layer.cumulative_length = n_cached
        if kvdirect and layer.form == "residual":
            if layer.is_sliding:
                needed_from = n_cached - layer.sliding_window + 1
                layer.calls = [c for c in layer.calls if c.end > needed_from]
            if not disk_tier:
                layer.load_resident()
            _restore_hot(layer, n_cached)


def _small_tensors(conversation: Any, index: int, layout: dict) -> dict[str, torch.Tensor]:
    """The per-layer ``.first`` / ``.calls`` index tensors, read by offset (the segment was
    verified when its layout was read). Not through ``safe_open``: with torch loaded it maps
    the whole file and costs tens of MiB of RSS for a few bytes."""
    from kvchat.engine.disk_tier import DiskRows, RowFile, read_rows

    names = [n for n in layout if n.endswith(".first") or n.endswith(".calls")]
    file = RowFile(conversation.segment_path(index))
    parts = [DiskRows(file, layout[n].offset, layout[n].shape, layout[n].dtype) for n in names]
    return dict(zip(names, read_rows(parts, "cpu")))


def _restore_kv(layer: Any, parts: list, n_cached: int) -> None:
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


def _restore_hot(layer: Any, n_cached: int) -> None:
    """Recompute the hot window's K/V from the checkpoints (same replay, same bits)."""
    if not layer.calls:
        return
    window = layer.owner.hot_window
    keep = n_cached if window is None else window
    if layer.is_sliding:
        keep = min(keep, layer.sliding_window - 1)
    keep = min(keep, n_cached - layer.calls[0].start)
    keys, values = layer._recompute(n_cached - max(keep, 1), n_cached)
    keys, values = keys[..., keys.shape[-2] - keep :, :], values[..., values.shape[-2] - keep :, :]
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys.contiguous(), values.contiguous()
