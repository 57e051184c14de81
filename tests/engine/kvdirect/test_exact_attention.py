"""kvchat's attention kernel gives the same bits however the keys and rows are split.

Property tests (hypothesis): random lengths up to 16K, head counts, GQA ratios, head dims,
sliding windows and dtypes. For each case, one call over the whole K/V, the same keys
folded in random windows (what the streamed path does), the K/V as strided token-major
views (what the in-place read-back path hands over), and each query row computed alone
(a decode step, or a recompute of one row) are ``torch.equal``. The reference for
accuracy is torch's SDPA with the same mask.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchat.engine.kvdirect import exact_attention
from kvchat.engine.kvdirect.exact_attention import AttentionState

pytestmark = pytest.mark.skipif(
    not exact_attention.available(), reason="no C compiler: kvchat's attention kernel is off"
)


def causal_mask(q_len: int, n: int, window: int | None) -> torch.Tensor:
    rows = torch.arange(q_len).unsqueeze(1) + (n - q_len)
    cols = torch.arange(n).unsqueeze(0)
    mask = cols <= rows
    if window:
        mask &= cols > rows - window
    return mask


@st.composite
def cases(draw):
    kv_heads = draw(st.sampled_from([1, 2, 3, 4]))
    groups = draw(st.sampled_from([1, 2, 3, 4]))
    dim = draw(st.sampled_from([16, 40, 64, 80, 128, 256]))
    long = draw(st.booleans())
    q_len = draw(st.integers(1, 8 if long else 96))
    past = draw(st.integers(0, 16_000 if long else 700))
    window = draw(st.one_of(st.none(), st.integers(1, 1200)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    cuts = draw(st.lists(st.integers(1, past + q_len), max_size=6))
    seed = draw(st.integers(0, 2**16))
    return kv_heads, groups, dim, q_len, past, window, dtype, sorted(set(cuts)), seed


def tensors(kv_heads, groups, dim, q_len, past, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = past + q_len
    query = torch.randn(1, kv_heads * groups, q_len, dim, generator=g).to(dtype)
    key = torch.randn(1, kv_heads, n, dim, generator=g).to(dtype)
    value = torch.randn(1, kv_heads, n, dim, generator=g).to(dtype)
    return query, key, value


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_whole_windowed_streamed_and_row_by_row_are_equal(case):
    kv_heads, groups, dim, q_len, past, window, dtype, cuts, seed = case
    query, key, value = tensors(kv_heads, groups, dim, q_len, past, dtype, seed)
    n = key.shape[-2]
    scale = dim**-0.5
    whole = exact_attention.exact_attention(query, key, value, scale, window)

    # Windows: the keys folded in pieces, as the streamed path hands them over.
    state = AttentionState(query, scale, n - q_len, window)
    bounds = [0, *[c for c in cuts if c < n], n]
    for a, b in zip(bounds, bounds[1:]):
        state.fold(key[:, :, a:b], value[:, :, a:b], a)
    assert torch.equal(state.finish(), whole)

    # Token-major strided views of one buffer, as the in-place read-back path hands them.
    rows = torch.empty(1, n, 2, kv_heads, dim, dtype=dtype)
    rows[:, :, 0] = key.transpose(1, 2)
    rows[:, :, 1] = value.transpose(1, 2)
    strided = exact_attention.exact_attention(
        query, rows[:, :, 0].transpose(1, 2), rows[:, :, 1].transpose(1, 2), scale, window
    )
    assert torch.equal(strided, whole)

    # Each row alone (a decode step is one row; a prefill chunk of any size holds it).
    for i in sorted({0, q_len // 2, q_len - 1}):
        alone = AttentionState(query[:, :, i : i + 1], scale, n - q_len + i, window)
        alone.fold(key, value, 0)
        assert torch.equal(alone.finish()[0, 0], whole[0, i])

    # And it is attention: close to SDPA over the same mask.
    mask = causal_mask(q_len, n, window)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask, scale=scale, enable_gqa=True
    ).transpose(1, 2)
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(whole.float(), ref, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 15, 16, 17, 64, 255, 256])
def test_a_row_alone_equals_the_row_in_a_batch_of_1_to_256(rows):
    """Batch invariance: rows share a call in lanes, but a lane's arithmetic is its own."""
    query, key, value = tensors(3, 3, 64, 256, 300, torch.float32, 7)
    n = key.shape[-2]
    batch = query[:, :, -rows:]
    out = exact_attention.exact_attention(batch, key, value, 0.125)
    last = query[:, :, -1:]
    alone = exact_attention.exact_attention(last, key, value, 0.125)
    assert torch.equal(alone[0, 0], out[0, -1])
    assert n == key.shape[-2]


def on_threads(monkeypatch, count: int) -> None:
    """The kernel's calls from here on run on ``count`` threads."""
    monkeypatch.setattr(exact_attention, "kernel_threads", lambda: count)


def test_thread_count_changes_no_bit(monkeypatch):
    query, key, value = tensors(2, 4, 64, 128, 2000, torch.float32, 3)
    on_threads(monkeypatch, 1)
    one = exact_attention.exact_attention(query, key, value, 0.125)
    on_threads(monkeypatch, 3)
    many = exact_attention.exact_attention(query, key, value, 0.125)
    assert torch.equal(one, many)


@pytest.mark.parametrize(
    ("kv_heads", "groups", "q_len", "dim", "window"),
    [(1, 4, 1, 256, None), (1, 4, 1, 256, 512), (3, 3, 1, 64, None), (1, 1, 1, 64, None),
     (2, 3, 2, 80, None), (4, 2, 1, 256, 300), (1, 7, 1, 128, None)],
)  # fmt: skip
def test_a_decode_steps_rows_shared_out_over_threads_keep_their_bits(
    monkeypatch, kv_heads, groups, q_len, dim, window
):
    """A decode step has a few query rows per K/V head; where there are fewer K/V heads than
    threads (Gemma 3 270M has one) each head's rows are shared out over the threads. Every
    count gives the one-thread bits, and each row still equals that row alone."""
    query, key, value = tensors(kv_heads, groups, dim, q_len, 900, torch.float32, 5)
    outs = {}
    for count in (1, 2, 3, 4, 16):
        on_threads(monkeypatch, count)
        outs[count] = exact_attention.exact_attention(query, key, value, 0.125, window)
    assert all(torch.equal(outs[1], out) for out in outs.values())
    for head in range(query.shape[1]):
        alone = exact_attention.exact_attention(
            query[:, head : head + 1], key[:, head // groups : head // groups + 1],
            value[:, head // groups : head // groups + 1], 0.125, window,
        )  # fmt: skip
        assert torch.equal(alone[0, :, 0], outs[2][0, :, head])


def compiled(tmp_path_factory, name: str, flags: list[str]):
    """The kernel compiled with ``flags`` in a folder of its own (x86 flags: skipped elsewhere)."""
    import platform

    from kvchat.engine.kvdirect.exact_attention import compile_kernel, compiler, load_kernel

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the builds' flags are x86 ones")
    target = tmp_path_factory.mktemp(name) / f"{name}.so"
    assert compile_kernel(compiler(), target, flags)
    return load_kernel(target)


@pytest.fixture(scope="module")
def portable_build(tmp_path_factory):
    """The kernel built from its plain C loops alone, compiled once for the builds below."""
    from kvchat.engine.kvdirect.exact_attention import PORTABLE_FLAGS

    return compiled(tmp_path_factory, "portable", PORTABLE_FLAGS)


@pytest.fixture(scope="module")
def build_of(tmp_path_factory):
    """The kernel of a named build: "native" (None: the one kvchat built here) or "avx2"
    (compiled once for the tests below, on any x86 CPU)."""
    from kvchat.engine.kvdirect.exact_attention import AVX2_FLAGS

    return {"native": None, "avx2": compiled(tmp_path_factory, "avx2", AVX2_FLAGS)}


@pytest.mark.parametrize("build", ["native", "avx2"])
def test_every_build_gives_the_portable_builds_bits(build, portable_build, build_of):
    """Each build's intrinsics (AVX-512, or AVX2 on CPUs without it) run each lane with the
    plain C loops' operations, so every build gives the same bits: this machine's own build
    and an AVX2 build are both compared with the portable one."""
    portable = portable_build
    kernel = build_of[build]
    for kv_heads, groups, dim, q_len, past, window, dtype in [
        (3, 3, 64, 1, 900, None, torch.float32),  # a decode step: the few-rows layout
        (2, 4, 80, 1, 700, 128, torch.bfloat16),  # few rows, a dim tail, a sliding window
        (1, 2, 40, 3, 300, None, torch.float32),  # few rows over a partial dim block
        (4, 2, 256, 1, 600, None, torch.bfloat16),  # Gemma 4B's decode step: 4 chunks of dim
        (1, 4, 256, 2, 1100, 512, torch.float32),  # Gemma 270M's heads, a window, 2 rows
        (3, 3, 64, 37, 500, None, torch.float32),  # rows in lanes, with a partial tile
        (2, 4, 40, 40, 300, None, torch.float32),  # rows in lanes over a partial dim block
        (3, 3, 64, 200, 300, 64, torch.bfloat16),  # sliding window, bf16 K/V
        (1, 4, 256, 24, 400, None, torch.float32),  # Gemma's head dim, rows in lanes
        (2, 2, 128, 64, 900, 300, torch.float32),  # keys entering and leaving windows
    ]:
        query, key, value = tensors(kv_heads, groups, dim, q_len, past, dtype, 11)
        n = key.shape[-2]
        built = AttentionState(query, 0.125, n - q_len, window, kernel=kernel)
        plain = AttentionState(query, 0.125, n - q_len, window, kernel=portable)
        for state in (built, plain):
            state.fold(key[:, :, :100], value[:, :, :100], 0)
            state.fold(key[:, :, 100:], value[:, :, 100:], 100)
        assert torch.equal(built.finish(), plain.finish()), (dim, q_len, past, window, dtype)


@pytest.mark.parametrize("build", ["native", "avx2"])
def test_ties_and_a_max_that_moves_every_key_keep_the_portable_bits(
    build, portable_build, build_of
):
    """The vectorised decode layout takes a block's running max as a scan, not key by key:
    where scores tie (repeated keys, +0 and -0), where the max moves at every key (scores
    rising), where a key scores NaN, and where a sliding window or a causal edge cuts a
    block in the middle of its keys, every build still gives the portable build's bits (NaN
    where it gives NaN)."""
    kernel = build_of[build]
    g = torch.Generator().manual_seed(3)
    dim, n = 64, 203
    # 2 kv heads of 2 query heads, 2 positions each; positive queries, so the first kv
    # head's keys (all elements equal, rising with position) score higher at every key.
    query = torch.randn(1, 4, 2, dim, generator=g).abs()
    rising = torch.linspace(-4, 4, n).view(1, 1, n, 1).expand(1, 1, n, dim)
    tied = torch.randn(1, 1, 1, dim, generator=g).expand(1, 1, n, dim).clone()
    tied[:, :, ::5] = 0.0
    tied[:, :, 1::5] = -0.0
    key = torch.cat([rising, tied], dim=1).contiguous()
    key[0, 1, 150, 3] = float("nan")  # seen by both rows unless the window has passed it
    value = torch.randn(1, 2, n, dim, generator=g)
    for window in (None, 1, 7, 37):
        built = AttentionState(query, 0.125, n - 2, window, kernel=kernel)
        plain = AttentionState(query, 0.125, n - 2, window, kernel=portable_build)
        for state in (built, plain):
            state.fold(key[:, :, :21], value[:, :, :21], 0)
            state.fold(key[:, :, 21:], value[:, :, 21:], 21)
        torch.testing.assert_close(
            built.finish(), plain.finish(), rtol=0, atol=0, equal_nan=True, msg=str(window)
        )


def test_a_mask_is_judged_by_what_it_shows_even_when_layers_share_one():
    """The layers of a forward call share one mask object, whose answer the kernel keeps
    for the next layer; another mask of the same shape, or the same mask over another
    window, is judged anew."""

    class Module:
        pass

    query = torch.zeros(1, 2, 1, 16)
    n = 40
    causal = torch.ones(1, 1, 1, n, dtype=torch.bool)
    hidden_first = causal.clone()
    hidden_first[..., 0] = False
    module = Module()
    for _ in range(3):  # layer after layer, one mask
        assert exact_attention.usable(module, query, causal, n, None)
        assert not exact_attention.usable(module, query, hidden_first, n, None)
    assert exact_attention.usable(module, query, hidden_first, n, n - 1)  # a window shows it
    assert not exact_attention.usable(module, query, causal, n, n - 1)
    additive = torch.zeros(1, 1, 1, n)
    assert exact_attention.usable(module, query, additive, n, None)
    del additive
    blocked = torch.full((1, 1, 1, n), float("-inf"))  # may reuse the freed mask's memory
    assert not exact_attention.usable(module, query, blocked, n, None)
