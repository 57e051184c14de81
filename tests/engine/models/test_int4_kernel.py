"""kvchat's int4 kernel: the right sums, one summation order for any row count, thread count
or build, and GGUF's Q4 numbers kept exactly."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import torch

from kvchat.engine.kvdirect.exact_attention import PORTABLE_FLAGS, compile_kernel, compiler
from kvchat.engine.models import int4_kernel, qlinear
from kvchat.threads import OnThreads

pytestmark = pytest.mark.skipif(not int4_kernel.available(), reason="no C compiler")


def _layer(
    n: int, k: int, seed: int = 0, *, tiled: bool = False
) -> tuple[dict[str, torch.Tensor], qlinear.Int4Linear]:
    torch.manual_seed(seed)
    parts = qlinear.quantize_int4(torch.randn(n, k) * 0.05)
    clone = {name: t.clone() for name, t in parts.items()}
    return parts, qlinear.Int4Linear(clone, None, tiled=tiled)


def _grid(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float64 weight the kernel's form stands for (its fp16 scales and minimums)."""
    _codes, scale_min = int4_kernel.kernel_form(parts)
    n, k = parts["qweight"].shape[0], parts["qweight"].shape[1] * 2
    codes = torch.stack([parts["qweight"] & 15, parts["qweight"] >> 4], dim=-1)
    q = codes.reshape(n, k // 32, 32).double()
    scale, minimum = scale_min[:, 0].double(), int4_kernel.minimums(scale_min).double()
    return (q * scale[..., None] + minimum[..., None]).reshape(n, k)


def test_the_kernel_computes_the_product_with_its_weights():
    parts, layer = _layer(300, 256)
    assert layer.form == "kvchat"
    x = torch.randn(7, 256)
    with torch.inference_mode():
        y = layer(x)
    expected = x.double() @ _grid(parts).T
    assert (y.double() - expected).abs().max() < 1e-5


def test_the_kernel_is_close_to_the_stored_weights():
    # fp16 scales: within a few parts in ten thousand of the float32 form quantize_int4 keeps
    parts, layer = _layer(64, 512, seed=1)
    x = torch.randn(3, 512)
    with torch.inference_mode():
        y = layer(x)
    exact = x.double() @ qlinear.dequantize_int4(parts).double().T
    assert (y.double() - exact).norm() / exact.norm() < 1e-3


def _on_threads(layer: torch.nn.Module, x: torch.Tensor, count: int) -> torch.Tensor:
    with OnThreads(count):
        return layer(x)


def assert_rows_bits_do_not_depend_on_the_call_or_the_threads(layer: torch.nn.Module) -> None:
    """``layer`` (1024 inputs) gives 67 rows the same bits in calls of 1-16 rows and on 1 or
    3 threads as in one call: what its ``rows_independent`` promises the cache."""
    assert layer.rows_independent
    x = torch.randn(67, 1024)
    with torch.inference_mode():
        whole = layer(x)
        for size in (1, 3, 4, 5, 16):
            chunks = torch.cat([layer(x[i : i + size]) for i in range(0, 67, size)])
            assert torch.equal(chunks, whole), size
        assert torch.equal(_on_threads(layer, x, 1), whole)
        assert torch.equal(_on_threads(layer, x, 3), whole)


def test_a_rows_bits_do_not_depend_on_the_call_or_the_threads():
    _parts, layer = _layer(1100, 1024, seed=2)  # over a million weights: two threads
    assert_rows_bits_do_not_depend_on_the_call_or_the_threads(layer)


tiles = pytest.mark.skipif(not int4_kernel.tiles_available(), reason="no AMX tiles here")


@tiles
def test_a_tiled_rows_bits_do_not_depend_on_the_call_or_the_threads():
    """Above the threshold a tiled layer's row gets the same bits in any tiled call (a
    different row count, a pass of 256 rows or several) and on any thread count; below it,
    the untiled layer's bits. It says it is not row-independent, so the cache replays its
    calls with their original rows."""
    _parts, untiled = _layer(1100, 1024, seed=2)
    _parts, layer = _layer(1100, 1024, seed=2, tiled=True)
    assert not layer.rows_independent
    low = int4_kernel.TILED_ROWS
    x = torch.randn(300, 1024)
    with torch.inference_mode():
        whole = layer(x)
        for start, size in ((0, low), (7, 100), (37, 263)):
            assert torch.equal(layer(x[start : start + size]), whole[start : start + size])
        assert torch.equal(_on_threads(layer, x, 1), whole)
        assert torch.equal(_on_threads(layer, x, 3), whole)
        few = x[: low - 1]
        assert torch.equal(layer(few), untiled(few))
        assert not torch.equal(whole[: low - 1], untiled(few))  # another summation


@tiles
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("rows", "n", "k"), [(64, 96, 320), (97, 1000, 2560), (300, 40, 1024)])
def test_the_tiles_compute_the_product_with_the_weights(symmetric, rows, n, k):
    """Against float64, with GGUF Q4_0 blocks (symmetric) and kvchat's own scale-and-minimum
    form: row counts off the tiles' 32, columns off their 16 and 128, k past one pass of 512
    and a group count off 32 (the minimums' extra k-steps), more rows than one pass."""
    torch.manual_seed(rows + n)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    parts = {"qweight": q[:, 0::2] | (q[:, 1::2] << 4)}
    parts["scales"] = (torch.rand(n, k // 32) * 0.01 + 1e-3).half()
    if not symmetric:
        parts["mins"] = (-torch.rand(n, k // 32) * 0.1).half()
    codes, scale_min = int4_kernel.kernel_form(parts)
    assert (scale_min.shape[1] == 1) is symmetric
    x = torch.randn(rows, k)
    tiled = int4_kernel.matmul(x, codes, scale_min, n, tiled=True)
    vector = int4_kernel.matmul(x, codes, scale_min, n)
    expected = x.double() @ qlinear.dequantize_int4(parts).double().T
    scale = expected.abs().max()
    # two bf16 halves keep 16 of an activation's 24 bits: a few parts in a million
    assert (tiled.double() - expected).abs().max() / scale < 3e-5
    assert (vector.double() - expected).abs().max() / scale < 3e-6
    assert not torch.equal(tiled, vector)


def test_the_plain_c_build_gives_the_vector_builds_bits(tmp_path):
    """The plain C, AVX2 and -march=native builds agree to the bit (with AVX-512 the last runs
    two rows to a register): at one row, at row counts that leave an odd row or a one-row
    tile, and over several tiles."""
    portable_path = tmp_path / "portable.so"
    assert compile_kernel(compiler(), portable_path, PORTABLE_FLAGS, source=int4_kernel.SOURCE)
    builds = {"portable": int4_kernel.load(portable_path)}
    native_path = tmp_path / "native.so"
    assert compile_kernel(compiler(), native_path, source=int4_kernel.SOURCE)
    builds["native"] = int4_kernel.load(native_path)
    if platform.machine() in {"x86_64", "AMD64"}:
        avx2_path = tmp_path / "avx2.so"
        flags = [*PORTABLE_FLAGS, "-mavx2", "-mfma", "-mf16c"]
        assert compile_kernel(compiler(), avx2_path, flags, source=int4_kernel.SOURCE)
        builds["avx2"] = int4_kernel.load(avx2_path)
    # 10 groups: the minimums' vector and scalar tails; 95 columns leave one thread an odd
    # column count (a single row takes the columns two at a time with AVX-512); a row of
    # 16,448 inputs is over what a single row lays out twice on the stack (TWICE_MAX_K).
    for n, k in ((96, 320), (95, 320), (5, 16448)):
        parts, _layer_ = _layer(n, k, seed=n)
        codes, scale_min = int4_kernel.kernel_form(parts)
        expected_weights = _grid(parts)
        for rows in (1, 2, 5, 17, 35):
            x = torch.randn(rows, k)
            outs = {}
            for name, library in builds.items():
                out, scratch = torch.empty(rows, n), torch.empty(rows * k // 32)
                library.kvchat_int4_matmul(
                    x.data_ptr(), rows, k, codes.data_ptr(), scale_min.data_ptr(), 0, n,
                    out.data_ptr(), scratch.data_ptr(), 2,
                )  # fmt: skip
                outs[name] = out
            expected = x.double() @ expected_weights.T
            for name, out in outs.items():
                # float32's rounding, which grows with the length of the sums
                assert (out.double() - expected).abs().max() < 1e-5 * k / 320, (name, n, rows)
                assert torch.equal(out, outs["portable"]), (name, n, rows)


def test_a_gguf_q4_blocks_numbers_are_held_exactly():
    """A GGUF block's own form (fp16 scales, and Q4_1's minimums) is held as it is, and a
    Q4_0 tensor symmetric ([N, 1, G]): the same bits as its minimums written out."""
    torch.manual_seed(4)
    d = (torch.rand(32, 4) * 0.01 + 1e-3).half()
    m = (-torch.rand(32, 4) * 0.1).half()
    q = torch.randint(0, 16, (32, 128), dtype=torch.uint8)
    qweight = q[:, 0::2] | (q[:, 1::2] << 4)
    q4_1 = {"qweight": qweight, "scales": d, "mins": m}
    q4_0 = {"qweight": qweight, "scales": d}
    blocks = q.view(32, 4, 32).float()
    expected_1 = (blocks * d.float()[..., None] + m.float()[..., None]).view(32, 128)
    expected_0 = ((blocks - 8) * d.float()[..., None]).view(32, 128)
    assert torch.equal(qlinear.dequantize_int4(q4_1), expected_1)
    assert torch.equal(qlinear.dequantize_int4(q4_0), expected_0)
    _codes, scale_min = int4_kernel.kernel_form(q4_1)
    assert torch.equal(scale_min[:, 0], d) and torch.equal(scale_min[:, 1], m)
    codes, symmetric = int4_kernel.kernel_form(q4_0)
    assert symmetric.shape == (32, 1, 4) and torch.equal(symmetric[:, 0], d)
    written_out = int4_kernel.full_form(symmetric)
    assert torch.equal(int4_kernel.minimums(symmetric), written_out[:, 1].float())
    x = torch.randn(3, 128)
    alone = int4_kernel.matmul(x, codes, symmetric, 32)
    assert torch.equal(alone, int4_kernel.matmul(x, codes, written_out, 32))
    assert (alone.double() - x.double() @ expected_0.double().T).abs().max() < 1e-5
    layer = qlinear.Int4Linear(q4_0, None)
    with torch.inference_mode():
        assert torch.equal(layer(x), alone)


def test_calls_from_several_threads_and_a_forked_child_share_the_workers_safely():
    """The kernel keeps its worker threads between calls: two Python threads calling it at
    once (ctypes lets go of the GIL) and a child forked after the workers started (it has
    none of them) get the same bits as one call alone."""
    import os
    import threading

    from kvchat.threads import OnThreads

    _parts, layer = _layer(1200, 1024, seed=5)
    x = torch.randn(3, 1024)
    with torch.inference_mode(), OnThreads(2):
        expected = layer(x)
        results: list[torch.Tensor] = []

        def call() -> None:
            for _ in range(20):
                results.append(layer(x))

        callers = [threading.Thread(target=call) for _ in range(2)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
        assert len(results) == 40 and all(torch.equal(r, expected) for r in results)
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if its call gives the same bits
            os._exit(0 if torch.equal(layer(x), expected) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


def test_the_repack_gives_the_same_codes_in_any_block_size(monkeypatch):
    """kernel_form rewrites the codes a block of rows at a time: any block size gives the
    whole matrix's codes."""
    torch.manual_seed(0)
    n, half = 1000, 320
    qweight = torch.randint(0, 256, (n, half), dtype=torch.uint8)
    parts = {"qweight": qweight, "scales": torch.rand(n, half * 2 // 32, dtype=torch.float16)}
    whole, _ = int4_kernel.kernel_form(parts)
    for block_bytes in (1, 999, 4096):
        monkeypatch.setattr(int4_kernel, "REPACK_BYTES", block_bytes)
        assert torch.equal(int4_kernel.kernel_form(parts)[0], whole)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_repack_of_a_vocabulary_table_has_no_peak():
    """A Gemma-3-sized vocabulary table (262,144 x 640) is repacked in a fresh process with
    VmHWM growing by under 2x its packed bytes, the codes included (the one-shot repack grew
    it by ~4x, which set the load's peak RSS)."""
    script = """
import json, torch
from kvchat.engine.models import int4_kernel
def hwm():
    return next(int(x.split()[1]) * 1024 for x in open("/proc/self/status")
                if x.startswith("VmHWM"))
q = torch.randint(0, 256, (262144, 320), dtype=torch.uint8)
s = torch.rand(262144, 20, dtype=torch.float16)
before = hwm()
int4_kernel.kernel_form({"qweight": q, "scales": s})
print(json.dumps({"growth": hwm() - before, "packed": q.numel()}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["growth"] < 2 * measured["packed"], measured


def test_the_kernel_runs_on_the_attention_kernels_workers(monkeypatch):
    """A decode step alternates the int4 kernel with the attention kernel, so the int4
    kernel runs its calls on the attention kernel's worker threads and starts none of its
    own (in a fresh process: a test here may have loaded it with attention off); on its own
    workers it gives the same bits."""
    import ctypes

    from kvchat.engine.kvdirect import exact_attention

    if not exact_attention.available():
        pytest.skip("no attention kernel to share workers with")
    script = """
import json, torch
from kvchat.engine.kvdirect import exact_attention
from kvchat.engine.models import int4_kernel, qlinear
from kvchat.threads import OnThreads
from kvchat.threads import OnThreads
layer = qlinear.Int4Linear(qlinear.quantize_int4(torch.randn(1200, 1024) * 0.05), None)
with torch.inference_mode(), OnThreads(2):
    layer(torch.randn(3, 1024))
print(json.dumps([int4_kernel.library().kvchat_pool_workers(),
                  exact_attention.library().kvchat_pool_workers()]))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    own, attention = json.loads(out.stdout.strip().splitlines()[-1])
    assert own == 0 and attention >= 1

    kernel = int4_kernel.library()
    kernel.kvchat_pool_share.argtypes = [ctypes.c_void_p]
    _parts, layer = _layer(1200, 1024, seed=6)
    x = torch.randn(3, 1024)
    # two kernel threads whatever count an earlier test in this process settled on
    monkeypatch.setattr(int4_kernel, "kernel_threads", lambda: 2)
    with torch.inference_mode():
        kernel.kvchat_pool_share(exact_attention.pool_runner())
        shared = layer(x)
        try:
            kernel.kvchat_pool_share(None)
            assert torch.equal(layer(x), shared)
            assert kernel.kvchat_pool_workers() >= 1
        finally:
            kernel.kvchat_pool_share(exact_attention.pool_runner())
