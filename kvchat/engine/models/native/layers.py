"""The decode step's layers through ``decode_layer.cpp``, for the models it serves.

What it serves: a :class:`~kvchat.engine.models.decode_step.DecodeStep` whose model kvchat
quantized on CPU, float32 activations, every layer's q/k/v and
gate/up stacked into one int4 or int8 kernel call each (``kvchat.engine.models.fused``) without
biases, o_proj and down_proj quantized alone, and a SiLU-gated MLP. That is the default
model's default form; anything else keeps the Python step.

Exactness: the library runs the Python step's own ATen ops in its order, so it must give the
same bits, and that is checked, not assumed: before a library is used, one layer runs both
ways on random inputs and every output must be ``torch.equal`` (:meth:`NativeLayers.agrees`);
a library that differs is not used. The cache then sees the same K/V whichever path ran,
and the K/V a checkpoint replays (the model's norm and projections, as before) still match.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["NativeLayers", "load_library", "serves"]

_loaded: set[str] = set()
KVCHAT_INT4 = -1  # the group argument that selects kvchat's int4 kernel


def load_library(path: str) -> bool:
    """Load the library into torch once per process; False if it will not load."""
    if path in _loaded:
        return True
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError):
        return False
    _loaded.add(path)
    return True


def _projection(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(weight, scales, group) of a lone quantized CPU projection without bias, else None
    (group 0: int8; -1: kvchat's int4 kernel)."""
    from kvchat.engine.models.qlinear import GROUP, Int4Linear, Int8Linear

    if getattr(module, "bias", None) is not None:
        return None
    if type(module) is Int4Linear and module.form == "torch":
        return module.packed, module.scales_and_zeros, GROUP
    if type(module) is Int4Linear and module.form == "kvchat":
        return module.packed, module.scale_min, KVCHAT_INT4
    if (
        type(module) is Int8Linear
        and module.qweight.is_cpu
        and not module.refine_top
        and not module.wide
    ):
        return module.qweight, module.kernel_scales, 0
    return None


def _stacked(group: Any) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    from kvchat.engine.models.qlinear import GROUP

    if group is None or group.has_bias:
        return None
    weight, scales = group.kernel_operands()
    return weight, scales, {"kvchat": KVCHAT_INT4, "torch": GROUP, "int8": 0}[group.form]


def _is_silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def serves(step: Any) -> bool:
    """Whether every layer of ``step`` has the form the library computes."""
    if not step.packs_gqa:
        return False
    for layer in step.layers:
        if _stacked(layer.qkv) is None or _stacked(layer.gate_up) is None:
            return False
        if len(layer.qkv.widths) != 3 or len(layer.gate_up.widths) != 2:
            return False
        if _projection(layer.o_proj) is None or _projection(layer.down) is None:
            return False
        if not _is_silu(layer.act):
            return False
        norms = (layer.input_norm.weight, layer.post_norm.weight)
        if any(w.dtype != torch.float32 or not w.is_cpu for w in norms):
            return False
    return True


class NativeLayers:
    """Each layer's arguments for the library's two halves, looked up once."""

    def __init__(self, step: Any) -> None:
        self.head_dim = step.head_dim
        self.before: list[tuple[Any, ...]] = []
        self.after: list[tuple[Any, ...]] = []
        for layer in step.layers:
            # The ops' argument order (decode_layer.cpp): a projection is (weight, scales,
            # group), a norm (weight, eps).
            input_norm = (layer.input_norm.weight, float(layer.input_norm.variance_epsilon))
            post_norm = (layer.post_norm.weight, float(layer.post_norm.variance_epsilon))
            qkv_widths = (layer.qkv.widths[0], layer.qkv.widths[1], self.head_dim)
            self.before.append((*input_norm, *_stacked(layer.qkv), *qkv_widths))
            self.after.append(
                (*_projection(layer.o_proj), *post_norm)
                + (*_stacked(layer.gate_up), layer.gate_up.widths[0], *_projection(layer.down))
            )
        from kvchat.engine.models import int4_kernel

        self.kernel = int4_kernel.function_address()
        ops = torch.ops.kvchat_native
        self._before_op = ops.before_attention
        self._after_op = ops.after_attention

    def before_attention(
        self, index: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._before_op(hidden, *self.before[index], cos, sin, self.kernel)

    def after_attention(
        self, index: int, residual: torch.Tensor, attended: torch.Tensor
    ) -> torch.Tensor:
        """The layer's output from its input and its attention output ([1, 1, H * d])."""
        return self._after_op(residual, attended, *self.after[index], self.kernel)

    def agrees(self, step: Any) -> bool:
        """Whether layer 0 gives the Python step's bits, on random inputs."""
        layer = step.layers[0]
        generator = torch.Generator().manual_seed(0)
        hidden_size = layer.input_norm.weight.shape[0]
        hidden = torch.randn(1, 1, hidden_size, generator=generator)
        cos = torch.randn(1, 1, 1, self.head_dim, generator=generator)
        sin = torch.randn(1, 1, 1, self.head_dim, generator=generator)
        with torch.inference_mode():
            mine = self.before_attention(0, hidden, cos, sin)
            theirs = step.python_before_attention(layer, hidden, cos, sin)
            if not all(torch.equal(a, b) for a, b in zip(mine, theirs)):
                return False
            width = layer.o_proj.in_features
            attended = torch.randn(1, 1, width, generator=generator)
            out = self.after_attention(0, hidden, attended)
            expected = step.after_attention(layer, hidden, attended)
        return bool(torch.equal(out, expected))
