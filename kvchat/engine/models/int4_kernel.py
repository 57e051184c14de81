"""kvchat's int4 weight kernel (``int4_kernel.c``): float32 activations, one fixed summation
order, loaded with ctypes.

Why not torch's ``_weight_int4pack_mm_for_cpu`` alone: it casts activations to bf16. This
kernel keeps float32's precision in one summation order, and is faster on a CPU without
AVX-512 at one row and at a prefill chunk's 64. With AVX-512, where it runs two rows (or, at
one row, two columns) to a register, it was faster at 64 rows and a little slower at one on a
Xeon; on an AMD EPYC it is about as fast at one row and up to 2x slower at 64, where torch's
bf16 activations halve the arithmetic (``benchmarks/bench_int4_kernel.py`` measures both).

Why not int8 activations, as llama.cpp's Q4 products use: tried, they were faster for
prefill but changed the default model's greedy answers and lowered its int4 top-1 agreement
with float32 in ``benchmarks/bench_weights.py`` (the README's Limits gives the figures).

Exactness: a row's output is summed in one order whatever the row count and thread count
(a decode row and the same row in a prefill chunk get the same bits); the plain C build
computes the AVX2 build's operations in its order, and the AVX-512 build runs them on two
rows at once (tests compare the builds).

It is built like the attention kernel (the C compiler on PATH, once per machine, into the
user cache). Without a compiler, off the CPU, or with ``KVCHAT_INT4_KERNEL=0``, int4 layers
run torch's kernel (:func:`available` says which).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvchat.threads import kernel_threads

SOURCE = Path(__file__).with_name("int4_kernel.c")
GROUP = 32
TILED_ROWS = 64  # the fewest rows a tiled call takes: below, the vector path is as fast
REPACK_BYTES = 2**20  # packed bytes rewritten at a time by kernel_form

__all__ = [
    "SOURCE",
    "TILED_ROWS",
    "available",
    "full_form",
    "function_address",
    "kernel_form",
    "library",
    "load",
    "matmul",
    "minimums",
    "takes_tiles",
    "tiles_available",
]

_library: ctypes.CDLL | None | bool = False  # False: not looked for yet


def load(path: Path) -> ctypes.CDLL | None:
    """The library at ``path`` with its function's signature, or None."""
    try:
        library = ctypes.CDLL(str(path))
    except OSError:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function = library.kvchat_int4_matmul
    i32 = ctypes.c_int32
    function.argtypes = [ptr, i64, i64, ptr, ptr, i32, i64, ptr, ptr, i32]
    function.restype = None
    tiled = getattr(library, "kvchat_int4_matmul_tiles", None)
    if tiled is not None:
        tiled.argtypes = function.argtypes
        tiled.restype = i32
        library.kvchat_int4_tiles_ready.argtypes = []
        library.kvchat_int4_tiles_ready.restype = i32
    return library


def _kernel() -> ctypes.CDLL | None:
    global _library
    if _library is False:
        from kvchat.engine.kvdirect.exact_attention import pooled_library

        _library = pooled_library("KVCHAT_INT4_KERNEL", SOURCE, load)
    return _library or None


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (built if need be), None without one."""
    return _kernel()


def available() -> bool:
    """Whether CPU int4 layers run this kernel (builds it if need be)."""
    return _kernel() is not None


_tiles: bool | None = None


def tiles_available() -> bool:
    """Whether ``matmul(..., tiled=True)`` can take the tiled path here: the kernel is built
    with AMX tiles, Linux lends them, and ``KVCHAT_INT4_TILES`` is not 0."""
    global _tiles
    if _tiles is None:
        from kvchat.engine.kvdirect.exact_attention import switched_on

        kernel = _kernel()
        _tiles = bool(
            kernel is not None
            and switched_on("KVCHAT_INT4_TILES")
            and hasattr(kernel, "kvchat_int4_tiles_ready")
            and kernel.kvchat_int4_tiles_ready() == 1
        )
    return _tiles


def function_address() -> int:
    """The address of the loaded kernel's function (the C++ decode layers call it), 0 when
    it is not built."""
    from kvchat.engine.kvdirect.exact_attention import symbol_address

    return symbol_address(_kernel(), "kvchat_int4_matmul")


def kernel_form(parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``(codes, scale_min)`` from a stored int4 form (``qlinear``): kvchat's
    ``qweight``/``scales``/``zeros`` (``w = (q - 8) * scales + zeros``), or a GGUF block's
    own fp16 ``scales`` and ``mins`` (``w = q * scales + mins``; without ``mins``, Q4_0's
    ``w = (q - 8) * scales``, kept symmetric: ``scale_min`` ``[N, 1, G]``).

    The minimum of the first form is ``zeros - 8 * scales`` in fp16 like the scale.
    The codes are rewritten a block of rows at a time: the whole matrix at once took several
    times its bytes in temporaries, which set the load's peak RSS for a vocabulary table."""
    qweight = parts["qweight"]
    n, half = qweight.shape
    groups = half * 2 // GROUP
    codes = torch.empty_like(qweight)
    step = max(1, REPACK_BYTES // half)
    for start in range(0, n, step):
        block = qweight[start : start + step]
        # Columns back in order, then each group's columns 0-15 in low nibbles, 16-31 in high.
        columns = torch.stack([block & 0x0F, block >> 4], dim=-1).reshape(-1, groups, GROUP)
        codes[start : start + step] = (columns[..., :16] | (columns[..., 16:] << 4)).reshape(
            -1, half
        )
    scales = parts["scales"]
    if "zeros" in parts:
        minimum = parts["zeros"].float() - 8 * scales.float()
        rows = [scales.float(), minimum]
    elif "mins" in parts:
        rows = [scales, parts["mins"]]
    else:
        rows = [scales]
    scale_min = torch.stack(rows, dim=1).to(torch.float16).contiguous()
    return codes, scale_min


def full_form(scale_min: torch.Tensor) -> torch.Tensor:
    """``scale_min`` with its minimums written out (a symmetric one's are -8 * its scales,
    exact in fp16): what a stack of symmetric and asymmetric layers holds."""
    if scale_min.shape[1] == 2:
        return scale_min
    return torch.cat([scale_min, scale_min * -8], dim=1).contiguous()


def minimums(scale_min: torch.Tensor) -> torch.Tensor:
    """Each group's minimum, ``[N, G]`` in float32."""
    if scale_min.shape[1] == 2:
        return scale_min[:, 1].float()
    return scale_min[:, 0].float() * -8


def takes_tiles(rows: int) -> bool:
    """Whether a ``tiled=True`` call of ``rows`` rows runs the tiled path."""
    return rows >= TILED_ROWS and tiles_available()


def matmul(
    rows: torch.Tensor,
    codes: torch.Tensor,
    scale_min: torch.Tensor,
    out_features: int,
    *,
    tiled: bool = False,
    library: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """``rows @ W.T`` in float32 (``rows`` ``[M, K]``; ``codes``/``scale_min`` may be a row
    range of a larger contiguous weight). ``tiled``: through the tiles where
    :func:`takes_tiles` says so (see the module's docstring). ``library``: another build of
    the kernel (:func:`load`), such as a benchmark's of an earlier revision; by default the
    one kvchat built."""
    kernel = library or _kernel()
    x = rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()
    m, k = x.shape
    out = torch.empty(m, out_features)
    scratch = torch.empty(m * (k // GROUP))
    if tiled and takes_tiles(m):
        failed = kernel.kvchat_int4_matmul_tiles(
            x.data_ptr(), m, k, codes.data_ptr(), scale_min.data_ptr(),
            int(scale_min.shape[1] == 1), out_features, out.data_ptr(), scratch.data_ptr(),
            kernel_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"no memory for the int4 kernel's buffers ({m} rows)")
        return out
    kernel.kvchat_int4_matmul(
        x.data_ptr(), m, k, codes.data_ptr(), scale_min.data_ptr(), int(scale_min.shape[1] == 1),
        out_features, out.data_ptr(), scratch.data_ptr(), kernel_threads(),
    )  # fmt: skip
    return out
