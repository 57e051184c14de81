"""The decode step's layers through ``decode_layer.cpp``, for the models it serves.

What it serves: a :class:`~kvchat.engine.models.decode_step.DecodeStep` of the Llama family
(a SiLU-gated MLP; Qwen2's q/k/v biases too) or of Gemma 3 (q/k norms, four norms per block,
a tanh-GELU-gated MLP) whose model kvchat quantized on CPU, float32 activations, every
layer's q/k/v and gate/up stacked into one int4 or int8 kernel call each
(``kvchat.engine.models.fused``), and o_proj and down_proj quantized alone without biases.
That is the default form of the default model, of a Gemma 3 GGUF and of a Qwen2 one;
anything else keeps the Python step.

Exactness: the library rounds the Python step's arithmetic as ATen does (ATen's own ops for
the norms' sums and the activations, plain loops for the ops that round each element once;
``decode_layer.cpp`` says which), so it must give the same bits, and that is checked, not
assumed: before a library is used, one layer runs both
ways on random inputs and every output must be ``torch.equal`` (:meth:`NativeLayers.agrees`);
a library that differs is not used. The cache then sees the same K/V whichever path ran,
and the K/V a checkpoint replays (the model's norm and projections, as before) still match.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvchat.threads import kernel_threads

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


def _stacked(group: Any, *, biased: bool = False) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(weight, scales, group) of a stacked projection; with ``biased`` its biases may be
    there (every member's, or none: see :func:`_stacked_bias`)."""
    from kvchat.engine.models.qlinear import GROUP

    if group is None or (group.has_bias and not biased):
        return None
    if group.has_bias and any(b is None for b in group.biases()):
        return None
    weight, scales = group.kernel_operands()
    return weight, scales, {"kvchat": KVCHAT_INT4, "torch": GROUP, "int8": 0}[group.form]


def _stacked_bias(group: Any) -> torch.Tensor | None:
    """The members' biases side by side (Qwen2's q/k/v), float32 like the activations."""
    if not group.has_bias:
        return None
    return torch.cat([b.to(torch.float32) for b in group.biases()])


def _is_silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _is_tanh_gelu(act: nn.Module) -> bool:
    """transformers' ``GELUTanh`` calling ``F.gelu(x, approximate="tanh")`` (not its Python
    formula, which rounds differently)."""
    call = getattr(act, "act", None)
    return (
        type(act).__name__ == "GELUTanh"
        and getattr(call, "func", None) is torch.nn.functional.gelu
        and getattr(call, "keywords", {}) == {"approximate": "tanh"}
    )


def _float_cpu(*weights: torch.Tensor) -> bool:
    return all(w.dtype == torch.float32 and w.is_cpu for w in weights)


def serves(step: Any) -> bool:
    """Whether every layer of ``step`` has the form the library computes."""
    if not step.packs_gqa or step.family not in ("llama", "gemma3"):
        return False
    gemma = step.family == "gemma3"
    for layer in step.layers:
        if _stacked(layer.qkv, biased=not gemma) is None or _stacked(layer.gate_up) is None:
            return False
        if len(layer.qkv.widths) != 3 or len(layer.gate_up.widths) != 2:
            return False
        if _projection(layer.o_proj) is None or _projection(layer.down) is None:
            return False
        if not (_is_tanh_gelu(layer.act) if gemma else _is_silu(layer.act)):
            return False
        if not _float_cpu(layer.input_norm.weight, layer.post_norm.weight):
            return False
        if gemma:
            parts = step.gemma[layer.index]
            norms = (parts.q_norm, parts.k_norm, parts.pre_ff_norm, parts.post_ff_norm)
            if not _float_cpu(*(n.weight for n in norms)):
                return False
    return True


def _norm(module: nn.Module) -> tuple[torch.Tensor, float]:
    """A norm's (weight, eps) in the ops' argument order (Llama's and Gemma's name eps
    differently)."""
    eps = getattr(module, "variance_epsilon", None)
    return module.weight, float(module.eps if eps is None else eps)


class NativeLayers:
    """Each layer's arguments for the library's two halves, looked up once."""

    def __init__(self, step: Any) -> None:
        self.head_dim = step.head_dim
        self.before: list[tuple[Any, ...]] = []
        self.after: list[tuple[Any, ...]] = []
        gemma = step.family == "gemma3"
        for layer in step.layers:
            # The ops' argument order (decode_layer.cpp): a projection is (weight, scales,
            # group), a norm (weight, eps).
            qkv_widths = (layer.qkv.widths[0], layer.qkv.widths[1], self.head_dim)
            if gemma:
                before = (*_norm(layer.input_norm), *_stacked(layer.qkv), *qkv_widths)
            else:
                qkv = (*_stacked(layer.qkv, biased=True), _stacked_bias(layer.qkv))
                before = (*_norm(layer.input_norm), *qkv, *qkv_widths)
            o_proj, post_norm = _projection(layer.o_proj), _norm(layer.post_norm)
            gate_up = (*_stacked(layer.gate_up), layer.gate_up.widths[0])
            if gemma:
                parts = step.gemma[layer.index]
                before += (*_norm(parts.q_norm), *_norm(parts.k_norm))
                after = (*o_proj, *post_norm, *_norm(parts.pre_ff_norm), *gate_up)
                after += (*_projection(layer.down), *_norm(parts.post_ff_norm))
            else:
                after = (*o_proj, *post_norm, *gate_up, *_projection(layer.down))
            self.before.append(before)
            self.after.append(after)
        from kvchat.engine.kvdirect import exact_attention
        from kvchat.engine.models import int4_kernel

        self.kernel = int4_kernel.function_address()
        # The attention kernel the attended half calls (0: not built; the step then calls
        # attention from Python).
        self.attention_kernel = exact_attention.kernel_address()
        ops = torch.ops.kvchat_native
        self._before_op = ops.gemma_before_attention if gemma else ops.before_attention
        self._after_op = ops.gemma_after_attention if gemma else ops.after_attention
        self._attended_op = (
            ops.gemma_attended_after_attention if gemma else ops.attended_after_attention
        )

    def before_attention(
        self, index: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._before_op(hidden, *self.before[index], cos, sin, self.kernel, kernel_threads())

    def after_attention(
        self, index: int, residual: torch.Tensor, attended: torch.Tensor
    ) -> torch.Tensor:
        """The layer's output from its input and its attention output ([1, 1, H * d])."""
        return self._after_op(residual, attended, *self.after[index], self.kernel, kernel_threads())

    def attended_after_attention(
        self,
        index: int,
        residual: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        window: int | None,
    ) -> torch.Tensor:
        """:func:`~kvchat.engine.kvdirect.exact_attention.exact_attention` of the query over
        the cache's K/V, then :meth:`after_attention`, in one call (the step asks
        ``takes_exact_kernel`` first; ``attention_kernel`` must be set)."""
        return self._attended_op(
            residual, query, key, value, scaling, int(window or 0), self.attention_kernel,
            *self.after[index], self.kernel, kernel_threads(),
        )  # fmt: skip

    def agrees(self, step: Any) -> bool:
        """Whether layer 0 gives the Python step's bits, on random inputs. The attended half
        is checked too, against the exact kernel called from Python; if it differs, only it
        is given up (``attention_kernel`` set to 0: the step calls attention from Python)."""
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
            if not torch.equal(out, expected):
                return False
            if self.attention_kernel and not self.attends_alike(hidden, mine, generator):
                self.attention_kernel = 0
        return True

    def attends_alike(
        self,
        hidden: torch.Tensor,
        projected: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        generator: torch.Generator,
    ) -> bool:
        """The attended half against exact_attention then the half, over 37 random keys
        (float32 and bfloat16 K/V, as caches hold them), with and without a window."""
        from kvchat.engine.kvdirect.exact_attention import exact_attention

        query, key, value = projected
        shape = (1, key.shape[1], 37, self.head_dim)
        for dtype, window in ((torch.float32, None), (torch.bfloat16, 5)):
            keys = torch.randn(shape, generator=generator).to(dtype)
            values = torch.randn(shape, generator=generator).to(dtype)
            scaling = self.head_dim**-0.5
            attended = exact_attention(query, keys, values, scaling, window)
            expected = self.after_attention(0, hidden, attended.reshape(1, 1, -1))
            out = self.attended_after_attention(0, hidden, query, keys, values, scaling, window)
            if not torch.equal(out, expected):
                return False
        return True
