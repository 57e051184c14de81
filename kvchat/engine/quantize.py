"""Weight-only quantization (optimum-quanto) and honest weight-byte accounting.

Why weight quantization at all: on the machines kvchat targets, weights dominate memory
(SmolLM2-135M is 540 MB in float32); int8 roughly quarters the Linear layers at a cost in
decode speed on CPU (DESIGN §3 measured ~4x slower decode for qint8).

Facts this module is built on (optimum-quanto 0.2.7, torch 2.13, measured on SmolLM2-135M):

* ``quantize(model, weights=qint8|qint4)`` then ``freeze(model)`` replaces each ``nn.Linear``
  weight with a ``WeightQBytesTensor`` (int8 ``_data`` + per-row ``_scale``) or a
  ``WeightQBitsTensor`` (``PackedTensor`` of uint8 holding two 4-bit values, plus per-group
  ``_scale`` and ``_shift``). ``nn.Embedding`` stays in float.
* qint4 models FAIL under ``torch.inference_mode`` ("Cannot set version_counter for inference
  tensor") and work under ``torch.no_grad``; qint8 works under both. Use
  :func:`inference_context` instead of picking one yourself.
* ``lm_head`` is excluded. With tied embeddings (SmolLM2, Gemma 3, Qwen2.5-0.5B, Llama 3.2)
  quantizing it unties it: the float embedding stays and an extra quantized copy of the
  vocabulary matrix appears, so memory goes UP. Excluding it also keeps the output logits at
  full precision, which matters for greedy ties. Measured on SmolLM2-135M (fp32 538 MB):
  int8 220 MB with lm_head excluded vs 249 MB quantized; int4 175 MB vs 191 MB. Both answer
  "What is the capital of France?" with Paris either way, so coherence did not force the
  choice; memory and logit precision did.
* CPU speed (SmolLM2, 1 thread, 8 greedy tokens): fp32 0.7 s, int8 1.4 s, int4 2.1 s.

Only ``torch`` / ``optimum.quanto`` imports happen inside functions, so importing this module
(and ``kvchat.engine.models``) stays cheap.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = [
    "WEIGHT_MODES",
    "inference_context",
    "is_quantized",
    "quantize_weights",
    "tensor_nbytes",
    "weights_nbytes",
]

WEIGHT_MODES: tuple[str, ...] = ("none", "int8", "int4")

# fnmatch patterns over module names (quanto's `exclude`); see the module docstring for why.
_EXCLUDE = ["lm_head", "*.lm_head"]


def quantize_weights(model: Any, weights: str) -> Any:
    """Quantize ``model``'s Linear weights in place to ``weights`` ("int8"/"int4") and freeze.

    Returns the same model for chaining. "none" is a no-op. Quantize AFTER moving the model to
    its device: quanto picks device-specific packed layouts at freeze time.
    """
    from kvchat.errors import ModelLoadError

    if weights == "none":
        return model
    if weights not in WEIGHT_MODES:
        raise ModelLoadError(f"unknown weights mode {weights!r}; use {', '.join(WEIGHT_MODES)}")
    try:
        from optimum.quanto import freeze, qint4, qint8, quantize
    except ImportError:
        raise ModelLoadError(
            f"--weights {weights} needs optimum-quanto; run `pip install optimum-quanto`"
        ) from None
    qtype = qint8 if weights == "int8" else qint4
    try:
        quantize(model, weights=qtype, exclude=_EXCLUDE)
        freeze(model)
    except Exception as exc:
        text = " ".join(str(exc).split())[:200]
        raise ModelLoadError(
            f"could not quantize weights to {weights} ({type(exc).__name__}: {text}); "
            "use --weights none or another device"
        ) from None
    return model


def is_quantized(model: Any, *, bits: int | None = None) -> bool:
    """True if any parameter is a quanto weight tensor (of ``bits`` bits, if given)."""
    from optimum.quanto import QTensor

    for param in model.parameters():
        if isinstance(param, QTensor):
            if bits is None or param.qtype.bits == bits:
                return True
    return False


def inference_context(model: Any) -> contextlib.AbstractContextManager[Any]:
    """The grad-free context to run ``model`` under.

    ``torch.inference_mode`` is faster, but quanto's 4-bit weights break under it (see the
    module docstring), so int4 models get ``torch.no_grad``.
    """
    import torch

    if _has_quanto() and is_quantized(model, bits=4):
        return torch.no_grad()
    return torch.inference_mode()


def _has_quanto() -> bool:
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        return False
    return True


def tensor_nbytes(tensor: Any, seen: set[tuple[str, int]] | None = None) -> int:
    """Bytes of storage behind ``tensor``, counting each storage once across calls with ``seen``.

    Wrapper subclasses (quanto's QTensors, PackedTensor) are opened with
    ``__tensor_flatten__`` and their inner tensors (``_data``, ``_scale``, ``_shift``) counted,
    because ``numel() * element_size()`` of the wrapper reports the float size it pretends to
    be, not what is resident.
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if seen is None:
        seen = set()
    if is_traceable_wrapper_subclass(tensor):
        names, _ctx = tensor.__tensor_flatten__()
        return sum(tensor_nbytes(getattr(tensor, name), seen) for name in names)
    if tensor.device.type == "meta":
        return 0
    storage = tensor.untyped_storage()
    ptr = storage.data_ptr()
    if ptr == 0:
        return 0
    key = (str(tensor.device), ptr)
    if key in seen:
        return 0
    seen.add(key)
    return int(storage.nbytes())


def weights_nbytes(model: Any) -> int:
    """Resident bytes of ``model``'s parameters and buffers.

    Tied weights (embedding = lm_head) are counted once; quantized weights by their real
    int8/packed-int4 storage plus scales. This is the "weights" figure the memory gauge shows
    beside the conversation state.
    """
    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        total += tensor_nbytes(tensor, seen)
    return total
