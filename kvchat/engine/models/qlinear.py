"""Weight-only quantized layers on CPU kernels: int8 per row, int4 per group.

The kernels: int4 runs kvchat's own (``kvchat.engine.models.int4_kernel``: float32
activations, one summation order for any row count; faster than torch's,
``benchmarks/bench_int4_kernel.py``) wherever a C compiler built it, else torch's
``_weight_int4pack_mm_for_cpu``; int8 runs ``_weight_int8pack_mm``. torch's two take bf16
activations: measured on a Xeon (AVX512-BF16, AMX), all of SmolLM2-135M's linears for one
decode token took fp32 ~47 ms, bf16 ~40 ms, int8 ~17.5 ms and int4 ~14 ms with bf16
activations, and with fp32 ones those kernels are 3-9x SLOWER than fp32, so activations are
cast to bf16 around them and back. torchao 0.18 installs beside torch 2.13 but calls these
same two kernels for its CPU int8/int4 weight-only layouts, behind tensor subclasses.
optimum-quanto (maintenance mode since Nov 2025) decoded 2x slower than fp32.

Formats (what is stored on disk, device independent):

* int8: ``qweight`` int8 ``[N, K]``, ``scales`` fp32 ``[N]``, symmetric: ``w = q * s``
  (an output head runs kvchat's ``int8_kernel`` where it is built: :class:`Int8Linear`).
* int4: ``qweight`` uint8 ``[N, K/2]`` (low nibble = even column), ``scales`` and ``zeros``
  fp32 ``[N, K/G]``, asymmetric per group of ``G`` input columns: ``w = (q - 8) * s + z``
  (the tinygemm convention); or, taken from a GGUF, its blocks' own fp16 numbers: ``scales``
  and ``mins`` fp16, ``w = q * s + m`` (Q4_1), or ``scales`` alone, ``w = (q - 8) * s``
  (Q4_0), the same bytes per weight as the file.

At load, each layer turns those into its kernel's own layout (kvchat's holds the group scale
and minimum in fp16, which keeps a GGUF Q4_0/Q4_1 block's numbers exactly; torch's holds
them in bf16). Off CPU (CUDA, MPS) the layers dequantize per call: correct, small in memory,
not fast. On CPU, ``kvchat.engine.models.fused`` then stacks the layers that read one input
(q/k/v, gate/up) into one kernel call each.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvchat.engine.models import int4_kernel, int8_kernel
from kvchat.threads import OnThreads, every_thread

GROUP = 32
INT4_INNER_K_TILES = 2  # the CPU packing's only tile count for K % 64 == 32 shapes (576)

HEAD_REFINE_TOP = 16
# A layer whose weights are at least this big runs on every thread even in a one-thread
# decode step (kvchat.threads): SmolLM2's 28 MB int8 head (its largest decoder layer is
# 0.4 MB). Both kernels give the same bits on one thread as on two at one row.
WIDE_BYTES = 8 * 2**20
# The projections the cache replays from residual checkpoints, several calls' rows at once
# (``kvchat.engine.kvdirect.arch``): they keep one summation order for any row count, so
# never take the int4 kernel's tiled path.
REPLAYED_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj", "c_attn")


def may_tile(name: str) -> bool:
    """Whether the layer at module path ``name`` may take the int4 kernel's tiled path."""
    return name.rsplit(".", 1)[-1] not in REPLAYED_PROJECTIONS


__all__ = [
    "REPLAYED_PROJECTIONS",
    "GROUP",
    "HEAD_REFINE_TOP",
    "Int4Embedding",
    "Int4Linear",
    "Int8Embedding",
    "Int8Linear",
    "dequantize_int4",
    "int4_holds",
    "int4_mm",
    "is_int4",
    "may_tile",
    "int4_supported",
    "int8_mm",
    "quantize_int4",
    "quantize_int8",
    "scales_and_zeros",
]


# -- quantizers (one tensor at a time) -------------------------------------------------------
_ROWS = 2048  # rows quantized at a time: temporaries stay a few MB for any matrix


def quantize_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric per-row int8 of a float ``[N, K]`` weight."""
    n, _k = weight.shape
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(n, dtype=torch.float32, device=weight.device)
    for start in range(0, n, _ROWS):
        w = weight[start : start + _ROWS].float()
        s = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q[start : start + _ROWS] = torch.round(w / s[:, None]).clamp(-127, 127)
        scales[start : start + _ROWS] = s
    return {"qweight": q, "scales": scales}


def int4_supported(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return k % GROUP == 0 and n % 8 == 0


def quantize_int4(weight: torch.Tensor, *, recover_grid: bool = False) -> dict[str, torch.Tensor]:
    """Asymmetric int4 per group of :data:`GROUP` input columns, nibble-packed.

    Each group's step is (max - min) / 15 (min/max), unless ``recover_grid``: then a group
    whose values already sit on a grid of ``k <= 15`` steps between its min and max (what a
    GGUF Q4_0, Q4_1 or Q4_K block dequantizes to) gets that grid's step, so its 4-bit codes
    are the file's own and the values come back (:func:`dequantize_int4`) to float32
    rounding. min/max alone re-expresses only the blocks whose codes reach both 0 and 15:
    every Q4_1 block, but few Q4_0 or Q4_K ones. (A GGUF's Q4_0 and Q4_1 tensors skip this:
    ``gguf_weights.GgufTensor.int4_parts`` reads their codes and scales from the file.)
    """
    n, k = weight.shape
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(n, k // GROUP, dtype=torch.float32, device=weight.device)
    zeros = torch.empty_like(scales)
    for start in range(0, n, _ROWS):
        w = weight[start : start + _ROWS].float()
        w = w.reshape(w.shape[0], k // GROUP, GROUP)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        steps = _grid_steps(w, lo, hi - lo) if recover_grid else 15.0
        s = ((hi - lo) / steps).clamp(min=1e-12)
        q = torch.round((w - lo[..., None]) / s[..., None]).clamp(0, 15).to(torch.uint8)
        q = q.reshape(q.shape[0], k)
        packed[start : start + _ROWS] = q[:, 0::2] | (q[:, 1::2] << 4)
        scales[start : start + _ROWS] = s
        zeros[start : start + _ROWS] = lo + 8.0 * s
    return {"qweight": packed, "scales": scales, "zeros": zeros}


# A group is on a k-step grid when every value is within this fraction of a step of it: the
# dequantized GGUF values carry float32 rounding, a thousandth of a step is far above it.
GRID_TOLERANCE = 1e-3


def _grid_steps(w: torch.Tensor, lo: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """Per group, the fewest steps ``k`` (1..15) whose grid from min to max holds every
    value; 15 for a group on no such grid (a float tensor's)."""
    steps = torch.full_like(lo, 15.0)
    offset = w - lo[..., None]
    for k in range(15, 0, -1):
        step = (span / k).clamp(min=1e-30)[..., None]
        r = offset / step
        on_grid = (r - r.round()).abs().amax(dim=-1) <= GRID_TOLERANCE
        steps = torch.where(on_grid, torch.full_like(steps, float(k)), steps)
    return steps


def is_int4(parts: dict[str, torch.Tensor]) -> bool:
    """Whether stored parts are an int4 form (their codes are nibble pairs) or int8."""
    return parts["qweight"].dtype == torch.uint8


def scales_and_zeros(parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Any stored int4 form's float32 ``(scales, zeros)``, ``w = (q - 8) * s + z``."""
    scales = parts["scales"].float()
    if "zeros" in parts:
        return scales, parts["zeros"].float()
    if "mins" in parts:
        return scales, parts["mins"].float() + 8 * scales
    return scales, torch.zeros_like(scales)


def dequantize_int4(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 ``[N, K]`` weight an int4 form stands for."""
    q = _unpack_int4(parts["qweight"]).float()
    n, k = q.shape
    q = q.reshape(n, k // GROUP, GROUP)
    if "zeros" in parts:
        w = (q - 8) * parts["scales"][..., None] + parts["zeros"][..., None]
    elif "mins" in parts:
        w = q * parts["scales"].float()[..., None] + parts["mins"].float()[..., None]
    else:
        w = (q - 8) * parts["scales"].float()[..., None]
    return w.reshape(n, k)


def int4_holds(weight: torch.Tensor, parts: dict[str, torch.Tensor]) -> bool:
    """Whether ``parts`` (from :func:`quantize_int4`) gives ``weight`` back: every value
    within :data:`GRID_TOLERANCE` of its group's step, i.e. the tensor was on 4-bit grids."""
    for start in range(0, weight.shape[0], _ROWS):
        rows = slice(start, start + _ROWS)
        chunk = {name: part[rows] for name, part in parts.items()}
        w = weight[rows].float()
        err = (dequantize_int4(chunk) - w).reshape(w.shape[0], -1, GROUP).abs().amax(dim=-1)
        if bool((err > GRID_TOLERANCE * chunk["scales"] + 1e-7).any()):
            return False
    return True


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    q = torch.empty(n, half * 2, dtype=torch.int32, device=packed.device)
    q[:, 0::2] = (packed & 0x0F).to(torch.int32)
    q[:, 1::2] = (packed >> 4).to(torch.int32)
    return q


# -- the CPU kernels (bf16 activations: with fp32 ones they are 3-9x slower) ---------------
def int8_mm(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``rows @ (qweight * scales).T`` on ``_weight_int8pack_mm``, in ``rows``' dtype."""
    return torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), qweight, scales).to(
        rows.dtype
    )


@functools.cache
def int8_rows_independent() -> bool:
    """Whether this machine's ``_weight_int8pack_mm`` gives a row the same bits in any call
    (other row counts, other thread counts). Its source says so (each output summed over
    the inputs in one order; blocks of rows and columns only pick the thread), but a torch
    upgrade could change the kernel, so it is checked once per process before the cache
    relies on it, on a few milliseconds of random operands."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(21, 1024, generator=generator) * 0.05
    parts = quantize_int8(weight)
    scales = parts["scales"].to(torch.bfloat16)
    x = torch.randn(37, 1024, generator=generator)
    with torch.inference_mode():
        whole = int8_mm(x, parts["qweight"], scales)
        for size in (1, 3, 4, 5, 16):
            chunks = [
                int8_mm(x[i : i + size], parts["qweight"], scales) for i in range(0, 37, size)
            ]
            if not torch.equal(torch.cat(chunks), whole):
                return False
        with OnThreads(1 if torch.get_num_threads() > 1 else 2):
            return torch.equal(int8_mm(x, parts["qweight"], scales), whole)


def int4_mm(
    rows: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """``rows @ W.T`` on ``_weight_int4pack_mm_for_cpu`` (group :data:`GROUP`), in ``rows``'
    dtype."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        rows.to(torch.bfloat16), packed, GROUP, scales_and_zeros
    ).to(rows.dtype)


# -- layers ----------------------------------------------------------------------------------
class Int8Linear(nn.Module):
    """``y = x @ (q * s).T + b`` with ``_weight_int8pack_mm`` on CPU (bf16 activations).

    ``refine_top=k`` marks the output head. torch's kernel's outputs are bf16, whose step at
    a logit of 25 is 0.125, and SmolLM2's two best first tokens for "What is the capital of
    France?" are 0.08 apart: bf16 logits tie them and greedy decoding answers "L'Étoile"
    instead of "Paris". So the head runs kvchat's int8 kernel where it is built
    (``int8_kernel``: float32 activations and logits, in one summation order, faster on a
    CPU without AVX-512: ``benchmarks/bench_int8_head.py``) and returns its float32 logits;
    on torch's kernel each row's ``k`` best bf16 logits are recomputed in float32 from the
    same int8 weights, which decides greedy choices as a float head would (a tie in bf16 is
    a gap of under one bf16 step, far inside the top 16).
    """

    def __init__(
        self, parts: dict[str, torch.Tensor], bias: torch.Tensor | None, refine_top: int = 0
    ) -> None:
        super().__init__()
        self.refine_top = refine_top
        self.out_features, self.in_features = parts["qweight"].shape
        self.register_buffer("qweight", parts["qweight"])
        self.register_buffer("scales", parts["scales"])
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernel_scales = self._runtime_scales()
        # None: torch's kernel serves (a decoder layer, off the CPU, or turned off)
        self.head_scales = self._head_scales()
        self.wide = parts["qweight"].nbytes >= WIDE_BYTES

    def _runtime_scales(self) -> torch.Tensor:
        return self.scales.to(torch.bfloat16) if self.qweight.is_cpu else self.scales

    def _head_scales(self) -> torch.Tensor | None:
        """The head's scales as kvchat's int8 kernel takes them (float32, contiguous)."""
        if not self.refine_top or not self.qweight.is_cpu:
            return None
        return self.scales.float().contiguous()

    @property
    def rows_independent(self) -> bool:
        """As :attr:`Int4Linear.rows_independent`: true on the CPU, where
        ``_weight_int8pack_mm`` sums each output over the inputs in one order whatever the
        call's row count or thread count (:func:`int8_rows_independent`). Off the CPU the
        dequantized ``F.linear`` is a GEMM whose summation may follow the row count."""
        return self.qweight.is_cpu and int8_rows_independent()

    def _apply(self, fn, recurse=True):  # keep the kernel's copy on the same device
        out = super()._apply(fn, recurse)
        self.kernel_scales = self._runtime_scales()
        self.head_scales = self._head_scales()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.head_scales is not None and int8_kernel.takes(self.qweight):
            y = int8_kernel.matmul(rows, self.qweight, self.head_scales)
        elif self.qweight.is_cpu:
            with every_thread() if self.wide else contextlib.nullcontext():
                y = int8_mm(rows, self.qweight, self.kernel_scales)
            if self.refine_top:
                self._refine(rows, y)
        else:
            y = F.linear(rows, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _refine(self, rows: torch.Tensor, y: torch.Tensor, block: int = 64) -> None:
        """Overwrite each row's ``refine_top`` best outputs of ``y`` with float32 ones."""
        k = min(self.refine_top, self.out_features)
        for start in range(0, rows.shape[0], block):
            x = rows[start : start + block].float()
            out = y[start : start + block]
            top = out.topk(k, dim=-1).indices  # [m, k]
            w = self.qweight[top].float()  # [m, k, in]
            exact = torch.einsum("mi,mki->mk", x, w) * self.scales[top]
            out.scatter_(1, top, exact.to(out.dtype))

    def extra_repr(self) -> str:
        refine = f", top {self.refine_top} in float32" if self.refine_top else ""
        return f"in={self.in_features}, out={self.out_features}, int8 per row{refine}"


class Int4Linear(nn.Module):
    """``y = x @ W.T + b``, ``W`` int4 per group.

    ``form`` says which kernel runs it: ``"kvchat"`` (CPU, ``kvchat.engine.models.int4_kernel``,
    float32 activations) where that kernel is built, else ``"torch"`` (CPU,
    ``_weight_int4pack_mm_for_cpu``, bf16 activations), and ``"portable"`` off the CPU
    (dequantized per call). ``packed`` is that kernel's weight, and ``scale_min`` (kvchat's)
    or ``scales_and_zeros`` (torch's) its group scales.

    ``float_output`` (an output head): kvchat's kernel's float32 outputs are returned as they
    are, not rounded to a bf16 model's dtype, where near-tied logits would tie (see
    :class:`Int8Linear`).

    ``tiled``: calls of many rows (a prefill chunk) may take kvchat's kernel's tiled path
    (``int4_kernel``'s docstring), several times faster but not the one-row path's bits. The
    loader turns it off for :data:`REPLAYED_PROJECTIONS`."""

    def __init__(
        self,
        parts: dict[str, torch.Tensor],
        bias: torch.Tensor | None,
        *,
        float_output: bool = False,
        tiled: bool = True,
    ) -> None:
        super().__init__()
        self.float_output = float_output
        packed = parts["qweight"]
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # The kernel's layouts only: the portable nibbles are not kept beside them.
        if packed.is_cpu and int4_kernel.available():
            codes, scale_min = int4_kernel.kernel_form(parts)
            self.register_buffer("packed", codes)
            self.register_buffer("scale_min", scale_min)
            self.form = "kvchat"
            self.tiled = tiled and int4_kernel.tiles_available()
        elif packed.is_cpu:
            scales, zeros = scales_and_zeros(parts)
            self.register_buffer(
                "packed",
                torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    _unpack_int4(packed), INT4_INNER_K_TILES
                ),
            )
            self.register_buffer(
                "scales_and_zeros",
                torch.stack([scales, zeros], dim=-1)
                .transpose(0, 1)
                .contiguous()
                .to(torch.bfloat16),
            )
            self.form = "torch"
            self.tiled = False
        else:
            scales, zeros = scales_and_zeros(parts)
            self.register_buffer("packed", packed)
            self.register_buffer("scales", scales)
            self.register_buffer("zeros", zeros)
            self.form = "portable"
            self.tiled = False

    @property
    def portable(self) -> bool:
        return self.form == "portable"

    @property
    def rows_independent(self) -> bool:
        """Whether a row's output is the same whatever other rows share the call: true of
        kvchat's kernel without its tiled path (one summation order for any row count and
        thread count), which lets the cache replay rows of several forward calls in one
        (``ArchAdapter.projects_rows_independently``)."""
        return self.form == "kvchat" and not self.tiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.form == "kvchat":
            y = int4_kernel.matmul(
                rows, self.packed, self.scale_min, self.out_features, tiled=self.tiled
            )
            y = y if self.float_output else y.to(x.dtype)
        elif self.form == "torch":
            y = int4_mm(rows, self.packed, self.scales_and_zeros)
        else:
            q = _unpack_int4(self.packed).to(x.dtype).reshape(self.out_features, -1, GROUP)
            w = (q - 8) * self.scales.to(x.dtype)[..., None] + self.zeros.to(x.dtype)[..., None]
            y = F.linear(rows, w.reshape(self.out_features, self.in_features))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int4 group {GROUP}, {self.form}"


class _TableEmbedding(nn.Module):
    """What the quantized embeddings share: the lookup's output dtype, the padding index, and
    Gemma 3's sqrt(hidden) factor (``embed_scale``, which its embedding module applies)."""

    def __init__(
        self,
        shape: tuple[int, int],
        dtype: torch.dtype,
        embed_scale: torch.Tensor | None,
        padding_idx: int | None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = shape
        self.out_dtype = dtype
        self.padding_idx = padding_idx
        if embed_scale is not None:
            self.register_buffer("embed_scale", embed_scale, persistent=False)
        else:
            self.embed_scale = None

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        """Looked-up rows in the output dtype, times the embedding scale if any."""
        rows = rows.to(self.out_dtype)
        if self.embed_scale is not None:
            rows = rows * self.embed_scale.to(self.out_dtype)
        return rows


class Int4Embedding(_TableEmbedding):
    """Rows of an int4 table (kvchat's kernel form), dequantized as they are looked up.

    It reads the tensors of an :class:`Int4Linear` (the tied output head, or a table of its
    own), so a tied vocabulary is held once. A row's values are ``q * scale + min`` in
    float32, each group's numbers as the table holds them (a GGUF Q4 table's own)."""

    def __init__(
        self,
        table: Int4Linear,
        dtype: torch.dtype,
        embed_scale: torch.Tensor | None = None,
        padding_idx: int | None = None,
    ) -> None:
        if table.form != "kvchat":
            raise ValueError("an int4 embedding reads kvchat's int4 kernel form")
        super().__init__((table.out_features, table.in_features), dtype, embed_scale, padding_idx)
        self.register_buffer("packed", table.packed)
        self.register_buffer("scale_min", table.scale_min)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        codes = self.packed[ids]  # [T, K/2]: byte j of a group holds columns j and j + 16
        codes = codes.reshape(-1, self.embedding_dim // GROUP, GROUP // 2)
        q = torch.cat([codes & 0x0F, codes >> 4], dim=-1).to(torch.float32)
        scale_min = self.scale_min[ids]  # [T, 1 or 2, groups]
        scale, minimum = scale_min[:, 0].to(torch.float32), int4_kernel.minimums(scale_min)
        rows = q * scale[..., None] + minimum[..., None]
        return self._scaled(rows.reshape(*input_ids.shape, self.embedding_dim))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int4 group {GROUP}"


class Int8Embedding(_TableEmbedding):
    """Rows of an int8 table times their scale.

    With tied embeddings the table's tensors are the ``lm_head``'s own (the same objects), so
    the vocabulary matrix is held once.
    """

    def __init__(
        self,
        parts: dict[str, torch.Tensor],
        dtype: torch.dtype,
        embed_scale: torch.Tensor | None = None,
        padding_idx: int | None = None,
    ) -> None:
        super().__init__(tuple(parts["qweight"].shape), dtype, embed_scale, padding_idx)
        self.register_buffer("qweight", parts["qweight"])
        self.register_buffer("scales", parts["scales"])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        dtype = self.out_dtype
        rows = self.qweight[input_ids].to(dtype) * self.scales[input_ids, None].to(dtype)
        return self._scaled(rows)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 per row"
