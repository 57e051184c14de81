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


def turn_tensors(cache: Any, since: int) -> dict[str, torch.Tensor]:
    """What the cache gained at positions >= ``since``, as CPU tensors for a segment file."""
    from kvchat.engine.cache import KVDirectCache

    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(cache, KVDirectCache) and layer.form == "residual":
            calls = [c for c in layer.calls if c.start >= since]
            if not calls:
                continue
            out[f"L{i}.residual"] = torch.cat([c.residual for c in calls], dim=1).cpu()
            out[f"L{i}.calls"] = torch.tensor([c.residual.shape[1] for c in calls])
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


def restore(session: ChatSession, segments: list[dict[str, torch.Tensor]], n_cached: int) -> None:
    """Rebuild ``session.cache`` from the saved segments, in turn order."""
    from kvchat.engine.cache import KVDirectCache, _Call

    cache = session.cache
    device = session.loaded.device
    kv_parts: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for tensors in segments:
        for i, layer in enumerate(cache.layers):
            if f"L{i}.first" not in tensors:
                continue
            first = int(tensors[f"L{i}.first"][0])
            if f"L{i}.residual" in tensors:
                if not isinstance(cache, KVDirectCache) or layer.form != "residual":
                    raise ValueError(f"layer {i} was saved as residuals but is not residual form")
                rows = tensors[f"L{i}.residual"].to(device)
                offset = 0
                for length in tensors[f"L{i}.calls"].tolist():
                    piece = rows[:, offset : offset + length].clone()
                    layer.calls.append(_Call(first + offset, piece))
                    offset += length
            else:
                k = tensors[f"L{i}.k"].to(device)
                v = tensors[f"L{i}.v"].to(device)
                kv_parts.setdefault(i, []).append((first, k, v))

    for i, layer in enumerate(cache.layers):
        parts = kv_parts.get(i)
        if parts:
            _restore_kv(layer, parts, n_cached)
        layer.cumulative_length = n_cached
        if isinstance(cache, KVDirectCache) and layer.form == "residual":
            _restore_hot(layer, n_cached)


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
    if layer.is_sliding:
        needed_from = n_cached - layer.sliding_window + 1
        layer.calls = [c for c in layer.calls if c.end > needed_from]
    window = layer.owner.hot_window
    keep = n_cached if window is None else window
    if layer.is_sliding:
        keep = min(keep, layer.sliding_window - 1)
    keep = min(keep, n_cached - layer.calls[0].start)
    keys, values = layer._recompute(n_cached - max(keep, 1), n_cached)
    keys, values = keys[..., keys.shape[-2] - keep :, :], values[..., values.shape[-2] - keep :, :]
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys.contiguous(), values.contiguous()
