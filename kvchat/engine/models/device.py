"""The torch device and dtype a model runs on: ``--device`` / ``--dtype`` checked, ``auto``
resolved. torch is imported inside the functions."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.errors import ModelLoadError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


def pick_device(device: str = "auto") -> torch.device:
    """``auto`` → cuda if available, else mps if available, else cpu; others are checked."""
    import torch

    name = device.strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ModelLoadError(
            f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("CUDA is not available in this torch build; use --device cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelLoadError(
            f"there is no {device!r} (this machine has {torch.cuda.device_count()} CUDA "
            "devices); use --device cuda or auto"
        )
    if dev.type == "mps" and not _mps_available():
        raise ModelLoadError("MPS is not available on this machine; use --device cpu or auto")
    if dev.type not in {"cpu", "cuda", "mps"}:
        raise ModelLoadError(f"unsupported device {device!r}; use auto, cpu, cuda or mps")
    return dev


def _mps_available() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def pick_dtype(
    dtype: str, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """The compute dtype for ``--dtype``; ``auto`` (the default) keeps the checkpoint's own.

    ``auto``: on CPU the checkpoint's dtype (``checkpoint_dtype``, see
    :func:`checkpoint_dtype`) when it is bfloat16 or float32, so a bf16 checkpoint is never
    widened to twice its size; float16 checkpoints run in float32 on CPU (CPU float16 kernels
    are slow, and Gemma 3 overflows in float16); float32 when the dtype is unknown. On
    CUDA/MPS bfloat16 (float16 only on GPUs without bf16).
    """
    import torch

    name = _DTYPE_ALIASES.get(dtype.strip().lower(), dtype.strip().lower())
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "mps":
            return torch.bfloat16
        return torch.bfloat16 if checkpoint_dtype == "bfloat16" else torch.float32
    if name not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return getattr(torch, _DTYPES[name])


_SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def checkpoint_dtype(model_dir: Path | None) -> str | None:
    """The float dtype most of a checkpoint's weight bytes are stored in (read from the
    safetensors headers, which is what the bytes are, not what config.json says), or None."""
    from kvchat.engine.models.weights_file import read_header

    if model_dir is None:
        return None
    counts: dict[str, int] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            entries, _meta, _start = read_header(path)
        except (OSError, ValueError):
            continue
        for entry in entries.values():
            name = _SAFETENSORS_FLOATS.get(entry.get("dtype", ""))
            if name is not None:
                begin, end = entry["data_offsets"]
                counts[name] = counts.get(name, 0) + end - begin
    return max(counts, key=counts.__getitem__) if counts else None
