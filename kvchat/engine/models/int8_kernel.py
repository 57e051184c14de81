"""kvchat's int8 head kernel (``int8_kernel.c``): float32 activations times int8 weights with
one scale per output row, in one fixed summation order, loaded with ctypes.

Why not torch's ``_weight_int8pack_mm`` for the output head: it takes bf16 activations and
gives bf16 logits (near-equal logits tie, so the head recomputed its best ones in float32),
and on a CPU without AVX-512 it reads a small model's head, the largest matrix such a model
has, at a fraction of the memory's speed (``benchmarks/bench_int8_head.py``). This kernel's
logits are float32 sums, and a one-row call reads the weights at about the memory's speed.

Exactness: an output's bits depend on neither the call's row count nor the thread count nor
the build (the C file says how). Only the output head runs it: the decoder's int8
projections keep torch's kernel, which the C++ decode layers call too.

Built like kvchat's other kernels (the C compiler on PATH, once per machine, into the user
cache). Without a compiler, off the CPU, with ``k`` not a multiple of 8, or with
``KVCHAT_INT8_KERNEL=0``, the head runs torch's kernel (:func:`available` says which).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvchat.threads import kernel_threads

SOURCE = Path(__file__).with_name("int8_kernel.c")
LANES = 8  # the kernel's k must be a multiple of this

__all__ = ["LANES", "SOURCE", "available", "load", "matmul", "takes"]

_library: ctypes.CDLL | None | bool = False  # False: not looked for yet


def load(path: Path) -> ctypes.CDLL | None:
    """The library at ``path`` with its function's signature, or None."""
    try:
        library = ctypes.CDLL(str(path))
    except OSError:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function = library.kvchat_int8_matmul
    function.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int32]
    function.restype = None
    return library


def _kernel() -> ctypes.CDLL | None:
    global _library
    if _library is False:
        from kvchat.engine.kvdirect.exact_attention import pooled_library

        _library = pooled_library("KVCHAT_INT8_KERNEL", SOURCE, load)
    return _library or None


def available() -> bool:
    """Whether this kernel is built here (builds it if need be)."""
    return _kernel() is not None


def takes(qweight: torch.Tensor) -> bool:
    """Whether the kernel serves an int8 weight ``[N, K]``: contiguous on the CPU, K a
    multiple of 8."""
    return (
        qweight.is_cpu and qweight.is_contiguous() and qweight.shape[1] % LANES == 0 and available()
    )


def matmul(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``rows @ (qweight * scales[:, None]).T`` in float32 (``rows`` ``[M, K]``, ``qweight``
    int8 ``[N, K]`` contiguous, ``scales`` float32 ``[N]``)."""
    x = rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty(m, n)
    _kernel().kvchat_int8_matmul(
        x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), n, out.data_ptr(),
        kernel_threads(),
    )  # fmt: skip
    return out
