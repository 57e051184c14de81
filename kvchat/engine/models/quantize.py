"""Weight modes and honest weight-byte accounting.

``--weights none`` keeps the float weights in ``--dtype``; ``int8`` / ``int4`` replace every
decoder Linear with a weight-only quantized layer and the vocabulary matrix (embedding and
tied ``lm_head``) with one table (int8; a GGUF's 4-bit table stays int4); see ``qlinear``
for the kernels and why, ``quantized_load`` for loading them from files one tensor at a time.
:func:`quantize_weights` does the same in place on a float model already in memory (tiny
test models, models that do not come from safetensors files).

Only torch imports happen inside functions, so importing this module (and
``kvchat.engine.models.resolve``) stays cheap.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = [
    "CHOICES",
    "WEIGHT_MODES",
    "auto_weights",
    "check_mode",
    "inference_context",
    "is_quantized",
    "quantize_weights",
    "tensor_nbytes",
    "weights_nbytes",
]

WEIGHT_MODES: tuple[str, ...] = ("none", "int8", "int4")
CHOICES: tuple[str, ...] = ("auto", *WEIGHT_MODES)


def auto_weights(model_dir: Any, device_type: str) -> str:
    """What ``--weights auto`` (the default) means for a model directory on a device.

    On CPU, int4 for every checkpoint kvchat can read tensor by tensor (safetensors, and a
    converted GGUF's own tensors): the
    weights are most of a chat process's memory, and int4 holds a bf16 checkpoint in about a
    quarter of its bytes. A model converted from a GGUF had 4-bit linears in the file, which
    int4 group 32 re-expresses (exactly for Q4_0/Q4_1). The quality of each choice, against
    the float weights on real text, is measured by ``benchmarks/bench_weights.py`` and stated
    in the README. Full precision ("none") off the CPU, where the quantized layers are not
    fast, and for checkpoints without safetensors files.
    """
    from pathlib import Path

    from kvchat.engine.models.model_dir import GGUF_INDEX_NAME

    if device_type == "cpu" and model_dir is not None:
        model_dir = Path(model_dir)
        if any(model_dir.glob("*.safetensors")) or (model_dir / GGUF_INDEX_NAME).is_file():
            return "int4"
    return "none"


def check_mode(weights: str) -> None:
    from kvchat.errors import ModelLoadError

    if weights not in WEIGHT_MODES:
        raise ModelLoadError(f"unknown weights mode {weights!r}; use {', '.join(WEIGHT_MODES)}")


def quantize_weights(model: Any, weights: str) -> Any:
    """Quantize ``model``'s decoder Linears (and its vocabulary matrix to int8) in place.

    Returns the same model for chaining; "none" is a no-op. The float weights of each layer
    are released as it is replaced.
    """
    check_mode(weights)
    if weights == "none":
        return model
    import torch

    from kvchat.engine.models import qlinear

    names = {id(m): n for n, m in model.named_modules()}
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    dtype = embed.weight.dtype
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if not isinstance(module, torch.nn.Linear) or module is head:
                continue
            use4 = weights == "int4" and qlinear.int4_supported(module.weight)
            parts = (qlinear.quantize_int4 if use4 else qlinear.quantize_int8)(module.weight)
            parts = {k: v.to(module.weight.device) for k, v in parts.items()}
            bias = None if module.bias is None else module.bias.data
            if use4:
                new = qlinear.Int4Linear(parts, bias, tiled=qlinear.may_tile(name))
            else:
                new = qlinear.Int8Linear(parts, bias)
            _set_module(model, name, new)
        tied = head is not None and head.weight is embed.weight
        vocab = qlinear.quantize_int8(embed.weight)
        vocab = {k: v.to(embed.weight.device) for k, v in vocab.items()}
        scale = getattr(embed, "embed_scale", None)
        _set_module(
            model,
            names[id(embed)],
            qlinear.Int8Embedding(vocab, dtype, scale, getattr(embed, "padding_idx", None)),
        )
        if head is not None:
            parts = vocab if tied else qlinear.quantize_int8(head.weight)
            bias = None if head.bias is None else head.bias.data
            head8 = qlinear.Int8Linear(parts, bias, qlinear.HEAD_REFINE_TOP)
            _set_module(model, names[id(head)], head8)
    from kvchat.engine.models.decode_step import forget_decode_step
    from kvchat.engine.models.fused import fuse_siblings

    fuse_siblings(model)  # CPU kernel layers only; a no-op elsewhere
    forget_decode_step(model)  # a step built before would still call the float layers
    return model


def _set_module(model: Any, name: str, module: Any) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def is_quantized(model: Any, *, bits: int | None = None) -> bool:
    """True if any layer holds quantized weights (of ``bits`` bits, if given)."""
    from kvchat.engine.models.fused import weight_widths

    found = weight_widths(model)
    return bool(found) if bits is None else bits in found


def inference_context(model: Any) -> contextlib.AbstractContextManager[Any]:
    """The grad-free context to run ``model`` under (every weight mode runs under
    ``torch.inference_mode``; kept as a function so callers need not know)."""
    import torch

    return torch.inference_mode()


def tensor_nbytes(tensor: Any, seen: set[tuple[str, int]] | None = None) -> int:
    """Bytes of storage behind ``tensor``, counting each storage once across calls with ``seen``.

    Wrapper subclasses are opened with ``__tensor_flatten__`` and their inner tensors
    counted, because ``numel() * element_size()`` of a wrapper reports the float size it
    pretends to be, not what is resident.
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
