"""The torch device and dtype a model runs on: ``--device`` / ``--dtype`` checked, ``auto``
resolved. torch is imported inside the functions."""

from __future__ import annotations

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


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` → float32 on CPU (exact, and CPU fp16 kernels are slow), bfloat16 on CUDA/MPS
    (float16 only on GPUs without bf16; Gemma 3 overflows in float16)."""
    import torch

    name = _DTYPE_ALIASES.get(dtype.strip().lower(), dtype.strip().lower())
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "mps":
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return getattr(torch, _DTYPES[name])
