"""kvchat's int8 head kernel: the right sums, one summation order for any row count, thread
count or build, and the output head running it with the answers torch's refined head gave."""

from __future__ import annotations

import platform

import pytest
import torch

from kvchat.engine.chat.settings import CacheSettings
from kvchat.engine.kvdirect.exact_attention import PORTABLE_FLAGS, compile_kernel, compiler
from kvchat.engine.models import int8_kernel, qlinear
from kvchat.threads import OnThreads
from tests.engine.kvdirect.test_exact_ceilings import converse

pytestmark = pytest.mark.skipif(not int8_kernel.available(), reason="no C compiler")


def _weights(n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return qlinear.quantize_int8(torch.randn(n, k, generator=generator) * 0.05)


def _expected(x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    return x.double() @ (parts["qweight"].double() * parts["scales"].double()[:, None]).T


def test_the_kernel_computes_the_product_with_its_weights():
    parts = _weights(1000, 576, seed=0)
    x = torch.randn(3, 576)
    out = int8_kernel.matmul(x, parts["qweight"], parts["scales"])
    expected = _expected(x, parts)
    assert out.dtype == torch.float32
    assert (out.double() - expected).abs().max() / expected.abs().max() < 1e-6


def test_a_rows_bits_do_not_depend_on_the_call_the_threads_or_the_build(tmp_path):
    """The plain C, AVX2 and -march=native builds give the same bits, for a row alone or
    in a call of many, on one thread or two; column counts that leave a block's tail."""
    builds = {}
    portable = tmp_path / "portable.so"
    assert compile_kernel(compiler(), portable, PORTABLE_FLAGS, source=int8_kernel.SOURCE)
    builds["portable"] = int8_kernel.load(portable)
    native = tmp_path / "native.so"
    assert compile_kernel(compiler(), native, source=int8_kernel.SOURCE)
    builds["native"] = int8_kernel.load(native)
    if platform.machine() in {"x86_64", "AMD64"}:
        avx2 = tmp_path / "avx2.so"
        flags = [*PORTABLE_FLAGS, "-mavx2", "-mfma"]
        assert compile_kernel(compiler(), avx2, flags, source=int8_kernel.SOURCE)
        builds["avx2"] = int8_kernel.load(avx2)
    for n, k in ((2000, 320), (95, 72), (7, 8)):
        parts = _weights(n, k, seed=n)
        x = torch.randn(35, k)
        first = None
        for name, library in builds.items():
            for rows in (1, 5, 35):
                for threads in (1, 2):
                    out = torch.empty(rows, n)
                    library.kvchat_int8_matmul(
                        x.data_ptr(), rows, k, parts["qweight"].data_ptr(),
                        parts["scales"].data_ptr(), n, out.data_ptr(), threads,
                    )  # fmt: skip
                    assert (out.double() - _expected(x[:rows], parts)).abs().max() < 1e-5
                    first = out[0] if first is None else first
                    assert torch.equal(out[0], first), (name, n, k, rows, threads)


def test_the_head_returns_the_kernels_float32_logits_and_torchs_without_it(monkeypatch):
    parts = _weights(300, 64, seed=3)
    copy = {n: t.clone() for n, t in parts.items()}
    head = qlinear.Int8Linear(copy, None, qlinear.HEAD_REFINE_TOP)
    x = torch.randn(2, 64)
    with torch.inference_mode():
        out = head(x)
        assert out.dtype == torch.float32
        assert torch.equal(out, int8_kernel.matmul(x, parts["qweight"], parts["scales"]))
        with OnThreads(1):
            assert torch.equal(head(x[1:]), out[1:])  # a row alone, on one thread
        monkeypatch.setattr(int8_kernel, "takes", lambda qweight: False)
        torch_head = head(x)  # torch's kernel, its best 16 refined in float32
    assert not torch.equal(torch_head, out)
    assert torch.equal(torch_head.argmax(-1), out.argmax(-1))
    # a decoder layer (no refine_top) keeps torch's kernel
    layer = qlinear.Int8Linear({n: t.clone() for n, t in parts.items()}, None)
    assert layer.head_scales is None


@pytest.mark.slow
@pytest.mark.parametrize("smollm2_quantized", ["int4"], indirect=True)
def test_the_default_model_answers_a_real_chat_as_with_torchs_refined_head(
    smollm2_quantized, tmp_path, monkeypatch
):
    """The default model (int4 layers, int8 head): a three-turn chat's greedy replies are
    the same tokens with the kernel's float32 head as with torch's bf16 head whose best 16
    were recomputed in float32, and the logits stay within a bf16 step of each other."""
    loaded = smollm2_quantized
    head = loaded.model.get_output_embeddings()
    assert isinstance(head, qlinear.Int8Linear) and head.head_scales is not None
    assert int8_kernel.takes(head.qweight)
    ours, our_logits, _ = converse(loaded, CacheSettings(), tmp_path / "kernel", monkeypatch)
    monkeypatch.setattr(int8_kernel, "takes", lambda qweight: False)
    theirs, their_logits, _ = converse(loaded, CacheSettings(), tmp_path / "torch", monkeypatch)
    assert sum(len(t) for t in ours) >= 60
    assert ours == theirs
    for a, b in zip(our_logits, their_logits):
        assert a.dtype == torch.float32
        assert (a.float() - b.float()).abs().max() < 0.25  # two bf16 steps at a logit of 30
