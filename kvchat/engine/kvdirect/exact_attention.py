"""Attention whose bits do not depend on how the keys or the rows were split.

The promise that a ceiling changes memory and never the answer needs an attention sum
taken in one order on every path: K/V handed over whole, read straight into a buffer, or
streamed window by window from disk, under the standard cache or the bounded one, in a
decode step or a prefill chunk. torch's kernels do not give that: SDPA's blocks depend on
the key count, merging windows by their log-sum-exp rounds differently, and even an
elementwise ``exp`` takes a vector or a scalar path by where an element sits.

So kvchat owns the sum (``exact_attention.c``): each query row folds the keys in position
order, one at a time, into a running (max, sum, weighted values) state, with its own
``exp`` and no reassociation. A row's bits then depend only on its query and the keys it
sees, never on the call they came in. :class:`AttentionState` carries that state across
calls: fold the cold windows, then the hot rows, then finish, and the output equals one
call over everything, ``torch.equal``.

The kernel is plain C, compiled once per machine with the C compiler on PATH (``$CC``,
``cc``, ``gcc`` or ``clang``; well under a second) into the user cache and loaded with
ctypes. Without a compiler, off the CPU, or with ``KVCHAT_EXACT_ATTENTION=0``, attention is
torch's (:func:`available` says which), and a streamed ceiling then promises the same
greedy tokens rather than the same bits.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from kvchat.threads import kernel_threads

SOURCE = Path(__file__).with_name("exact_attention.c")
# The worker threads every kvchat C kernel includes (the int4 and int8 ones too): part of each
# build.
POOL_HEADER = Path(__file__).with_name("worker_pool.h")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
# The portable build: no AVX-512, so the plain C loops run (the same bits, by construction).
PORTABLE_FLAGS = [f for f in _FLAGS if f != "-march=native"] + ["-mno-avx512f"]
# The AVX2 build (x86 CPUs without AVX-512): tests compare it with the portable one anywhere.
AVX2_FLAGS = [*PORTABLE_FLAGS, "-mavx2", "-mfma"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

__all__ = [
    "AttentionState",
    "available",
    "built_library",
    "compile_kernel",
    "compiler",
    "exact_attention",
    "kernel_address",
    "library",
    "pool_runner",
    "pooled_library",
    "share_pool",
    "switched_on",
    "symbol_address",
    "usable",
    "window_of",
]

_library: ctypes.CDLL | None | bool = False  # False: not looked for yet


def switched_on(variable: str) -> bool:
    """Whether an on-by-default switch of kvchat's native code is on: off when the variable
    is ``0``, ``off``, ``false`` or ``no`` (``KVCHAT_EXACT_ATTENTION``, ``KVCHAT_INT4_KERNEL``,
    ``KVCHAT_INT8_KERNEL``, ``KVCHAT_NATIVE``)."""
    return os.environ.get(variable, "1").strip().lower() not in {"0", "off", "false", "no"}


def compiler() -> str | None:
    chosen = os.environ.get("CC")
    if chosen:
        return shutil.which(chosen)
    return next((f for c in ("cc", "gcc", "clang") if (f := shutil.which(c))), None)


def _machine_key(cc: str, source: Path = SOURCE) -> str:
    """Source (with the header it includes), compiler and this CPU's features: -march=native
    builds for this processor."""
    digest = hashlib.sha256(source.read_bytes())
    digest.update(POOL_HEADER.read_bytes())
    digest.update(f"{cc}|{' '.join(_FLAGS)}|{platform.machine()}|{sys.platform}".encode())
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                digest.update(line.encode())
                break
    return digest.hexdigest()[:16]


def compile_kernel(
    cc: str, target: Path, flags: list[str] | None = None, source: Path = SOURCE
) -> bool:
    """Compile the kernel (or another of kvchat's C files) into ``target`` (written aside,
    then renamed: two processes never load half a file); False if the compiler fails."""
    temporary = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        command = [cc, *(flags or _FLAGS), f"-I{POOL_HEADER.parent}", str(source)]
        done = subprocess.run(
            [*command, "-o", str(temporary), "-lm", "-pthread"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=120,
        )
        if done.returncode != 0 or not temporary.exists():
            return False
        os.replace(temporary, target)
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink()


def load_kernel(path: Path) -> ctypes.CDLL | None:
    """The compiled kernel at ``path`` with its functions' signatures, or None."""
    try:
        library = ctypes.CDLL(str(path))
    except OSError:
        return None
    fold = library.kvchat_attention_fold
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fold.argtypes = [
        ptr, i64, i64, i64, i64, ptr, ctypes.c_float, i64,
        ptr, ptr, ctypes.c_int32, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int32,
    ]  # fmt: skip
    fold.restype = None
    library.kvchat_attention_init.argtypes = [ptr, ptr, ptr, i64, i64]
    library.kvchat_attention_init.restype = None
    library.kvchat_attention_finish.argtypes = [ptr, ptr, i64, i64, i64, ptr]
    library.kvchat_attention_finish.restype = None
    whole = getattr(library, "kvchat_attention", None)  # not in builds of older sources
    if whole is not None:
        whole.argtypes = [
            ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64,
            ptr, ptr, ctypes.c_int32, i64, i64, i64, i64, i64, ptr, ctypes.c_int32,
        ]  # fmt: skip
        whole.restype = ctypes.c_int32
    return library


def built_library(source: Path) -> Path | None:
    """``source`` compiled for this machine into the user cache (once; later calls find it),
    or None without a working C compiler."""
    from kvchat.paths import cache_dir

    cc = compiler()
    if cc is None:
        return None
    target = cache_dir() / "native" / f"{source.stem}-{_machine_key(cc, source)}.so"
    if not target.exists() and not compile_kernel(cc, target, source=source):
        return None
    return target


def _build() -> ctypes.CDLL | None:
    target = built_library(SOURCE)
    return None if target is None else load_kernel(target)


def _kernel() -> ctypes.CDLL | None:
    global _library
    if _library is False:
        _library = _build() if switched_on("KVCHAT_EXACT_ATTENTION") else None
    return _library or None


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (built if need be), None without one."""
    return _kernel()


def symbol_address(library: ctypes.CDLL | None, name: str) -> int:
    """The address of function ``name`` in a loaded kvchat library (for C or C++ code that
    calls it directly), 0 without the library or the function."""
    function = getattr(library, name, None)
    return 0 if function is None else ctypes.cast(function, ctypes.c_void_p).value or 0


def kernel_address() -> int:
    """The address of the loaded kernel's whole-call function (``kvchat_attention``), which
    kvchat's C++ decode layers call with :func:`exact_attention`'s operands; 0 when it is
    not built."""
    return symbol_address(_kernel(), "kvchat_attention")


def pool_runner() -> int:
    """The address of the loaded kernel's ``kvchat_pool_run`` (its worker threads, which
    kvchat's other C kernels share: ``worker_pool.h`` says why), 0 when it is not built."""
    return symbol_address(_kernel(), "kvchat_pool_run")


def share_pool(library: ctypes.CDLL) -> None:
    """Run another of kvchat's C libraries' calls on this kernel's worker threads, when it is
    built: a decode step alternates the kernels, and one warm pool serves them all faster
    than several that fall asleep in turn (``worker_pool.h``). Bits do not depend on the
    pool."""
    share = getattr(library, "kvchat_pool_share", None)
    runner = pool_runner()
    if share is not None and runner:
        share.argtypes = [ctypes.c_void_p]
        share.restype = None
        share(runner)


def pooled_library(
    variable: str, source: Path, load: Callable[[Path], ctypes.CDLL | None]
) -> ctypes.CDLL | None:
    """Another of kvchat's C kernels (the int4 and int8 weights'): ``source`` built for this
    machine, loaded by ``load`` and put on this kernel's pool (:func:`share_pool`); None
    when ``variable`` switches it off (:func:`switched_on`) or it cannot be built."""
    if not switched_on(variable):
        return None
    path = built_library(source)
    library = None if path is None else load(path)
    if library is not None:
        share_pool(library)
    return library


def available(device: torch.device | str = "cpu") -> bool:
    """Whether attention on ``device`` runs kvchat's exact kernel (builds it if need be)."""
    return torch.device(device).type == "cpu" and _kernel() is not None


class AttentionState:
    """The running state of every query row of one attention call, folded key by key.

    ``query`` is ``[1, heads, q_len, dim]``; query ``i`` sits at position ``q_pos0 + i`` in
    the key coordinates the folds use (keys ``[key_pos0, key_pos0 + n)``), and sees the keys
    at or before it (and, with ``window``, after ``position - window``)."""

    def __init__(
        self,
        query: torch.Tensor,
        scaling: float,
        q_pos0: int,
        window: int | None = None,
        kernel: ctypes.CDLL | None = None,
    ) -> None:
        self.query = _query_operand(query)
        heads, q_len, dim = self.shape = tuple(self.query.shape)
        self.out_dtype = query.dtype
        self.positions = torch.arange(q_pos0, q_pos0 + q_len, dtype=torch.int64)
        self.scaling = float(scaling)
        self.window = int(window or 0)
        self.kernel = kernel or _kernel()  # another build: tests compare builds
        self.max = torch.empty(heads * q_len)
        self.sum = torch.empty(heads * q_len)
        self.acc = torch.empty(heads * q_len, dim)
        self.kernel.kvchat_attention_init(
            self.max.data_ptr(), self.sum.data_ptr(), self.acc.data_ptr(), heads * q_len, dim
        )

    def fold(self, key: torch.Tensor, value: torch.Tensor, key_pos0: int) -> None:
        """Fold ``key``/``value`` (``[1, kv_heads, n, dim]``, any row and head strides) in."""
        n = key.shape[-2]
        if n == 0:
            return
        key, value = _kernel_operands(key, value)
        heads, q_len, dim = self.shape
        kv_heads = key.shape[1]
        self.kernel.kvchat_attention_fold(
            self.query.data_ptr(), heads, q_len, dim, kv_heads, self.positions.data_ptr(),
            self.scaling, self.window, key.data_ptr(), value.data_ptr(), _DTYPES[key.dtype],
            key.stride(1), key.stride(2), value.stride(1), value.stride(2), n, key_pos0,
            self.max.data_ptr(), self.sum.data_ptr(), self.acc.data_ptr(), kernel_threads(),
        )  # fmt: skip

    def finish(self) -> torch.Tensor:
        """The attention output, ``[1, q_len, heads, dim]`` in the query's dtype (the layout
        transformers' attention functions return)."""
        heads, q_len, dim = self.shape
        out = torch.empty(1, q_len, heads, dim)
        self.kernel.kvchat_attention_finish(
            self.sum.data_ptr(), self.acc.data_ptr(), heads, q_len, dim, out.data_ptr()
        )
        return out if self.out_dtype == torch.float32 else out.to(self.out_dtype)


def _query_operand(query: torch.Tensor) -> torch.Tensor:
    """``query`` (``[1, heads, q_len, dim]``) as the kernel reads it: ``[heads, q_len, dim]``,
    float32, contiguous."""
    if query.shape[0] != 1:
        raise ValueError("exact attention takes one sequence at a time")
    return query[0].to(torch.float32).contiguous()


def _kernel_operands(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V as the kernel reads them: float32 or bfloat16 alike, unit stride along dim."""
    if key.dtype not in _DTYPES or key.dtype != value.dtype:
        key, value = key.float(), value.float()
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    return key, value


def exact_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the last ``q_len`` positions over ``key``/``value`` (the new rows
    last, as a cache returns them), ``[1, q_len, heads, dim]``: what an
    :class:`AttentionState` folding them all at once gives, in one call to the kernel (a
    decode step makes one per layer, so the state's own tensors would cost it more than
    they hold)."""
    q = _query_operand(query)
    heads, q_len, dim = q.shape
    n = key.shape[-2]
    key, value = _kernel_operands(key, value)
    out = torch.empty(1, q_len, heads, dim)
    failed = _kernel().kvchat_attention(
        q.data_ptr(), heads, q_len, dim, key.shape[1], n - q_len, float(scaling),
        int(window or 0), key.data_ptr(), value.data_ptr(), _DTYPES[key.dtype],
        key.stride(1), key.stride(2), value.stride(1), value.stride(2), n, out.data_ptr(),
        kernel_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"no memory for attention's state ({heads * q_len} rows)")
    return out if query.dtype == torch.float32 else out.to(query.dtype)


# The last answer of _positional, for the mask it was about (held weakly, so that no mask is
# kept alive): a forward call's layers of one kind share one mask object (Gemma 3's sliding
# layers, 15 of 18 in 270M), which transformers builds anew for each call and never writes
# into, so the same object over the same keys shows what it showed; building the expected
# pattern again for each layer was a visible part of a small model's decode step.
_last_positional: tuple[weakref.ref, int, int, int | None, bool] | None = None


def _positional(mask: torch.Tensor, q_len: int, n: int, window: int | None) -> bool:
    """Whether ``mask`` ([1, 1, q_len, n], bool or additive) shows exactly the causal (and
    sliding) pattern :func:`exact_attention` computes from positions."""
    global _last_positional
    last = _last_positional
    if last is not None and last[0]() is mask and last[1:4] == (q_len, n, window):
        return last[4]
    answer = _shows_positions(mask, q_len, n, window)
    _last_positional = (weakref.ref(mask), q_len, n, window, answer)
    return answer


def _shows_positions(mask: torch.Tensor, q_len: int, n: int, window: int | None) -> bool:
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1 or mask.shape[-1] != n:
        return False
    rows = torch.arange(q_len, device=mask.device).unsqueeze(1) + (n - q_len)
    cols = torch.arange(n, device=mask.device).unsqueeze(0)
    expected = cols <= rows
    if window:
        expected &= cols > rows - window
    visible = mask[0, 0, -q_len:] if mask.dtype == torch.bool else mask[0, 0, -q_len:] == 0
    return bool(torch.equal(visible, expected))


def usable(
    module: object,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    n_keys: int,
    window: int | None,
) -> bool:
    """Whether this call can run the exact kernel: one sequence on the CPU, no logit soft
    cap, no dropout, and a mask (if any) that is the causal (sliding ``window``) pattern
    over ``n_keys`` keys."""
    if query.shape[0] != 1 or query.device.type != "cpu" or _kernel() is None:
        return False
    if getattr(module, "attn_logit_softcapping", None) or getattr(module, "training", False):
        return False
    if attention_mask is None:
        return True
    return _positional(attention_mask, query.shape[-2], n_keys, window)


def window_of(module: object, kwargs: dict) -> int | None:
    """The sliding window a layer's attention call asks for (Mistral passes its config's;
    Gemma 3 and Qwen2 their layer's), None for full attention."""
    if "sliding_window" in kwargs:
        return kwargs["sliding_window"]
    return getattr(module, "sliding_window", None)
