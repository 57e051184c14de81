"""Stacked sibling projections (``kvchat.engine.models.fused``) change the call count, not a bit."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from kvchat.engine.kvdirect.arch import ArchAdapter
from kvchat.engine.models import int4_kernel, qlinear
from kvchat.engine.models.fused import FusedProjection, ProjectionGroup, fuse_siblings
from kvchat.engine.models.quantize import is_quantized, quantize_weights
from kvchat.lab.tiny_models import FAMILIES
from tests.engine.kvdirect.test_cache_exact import run_conversation, tiny_model
from tests.engine.kvdirect.test_thread_counts import smollm2_shaped


def unfused(family: str, mode: str, dtype=torch.float32):
    """The model quantized the same way, its siblings left as separate layers."""
    import kvchat.engine.models.fused as fused

    model = tiny_model(family, dtype)
    saved = fused.SIBLINGS
    fused.SIBLINGS = ()
    try:
        return quantize_weights(model, mode)
    finally:
        fused.SIBLINGS = saved


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "mistral"])
def test_stacked_siblings_give_the_separate_layers_bits(family, mode):
    separate = unfused(family, mode)
    model = copy.deepcopy(separate)
    groups = fuse_siblings(model)
    layers = model.config.num_hidden_layers
    # gate/up everywhere; q/k/v where the kernel's packing stacks (widths of 64s; these tiny
    # k/v widths of 32 do not, and the bit check leaves them apart)
    assert groups >= layers
    assert is_quantized(model, bits=4 if mode == "int4" else 8)
    ref = run_conversation(separate, DynamicCache(config=separate.config))
    for cache_kind in ("standard", "kvdirect"):
        if cache_kind == "standard":
            got = run_conversation(model, DynamicCache(config=model.config))
        else:
            from kvchat.engine.kvdirect.cache import KVDirectCache

            adapter = ArchAdapter(model)
            cache = KVDirectCache(adapter, ["residual"] * adapter.num_layers, 4).attach()
            got = run_conversation(model, cache)  # K/V replayed through k_proj, v_proj alone
            assert cache.stats.recomputed_tokens > 0
            cache.detach()
        assert got[0] == ref[0]
        assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1])), cache_kind


def test_the_stacked_weights_replace_the_separate_ones():
    separate = unfused("llama", "int4")
    before = sum(b.nbytes for b in separate.buffers())
    model = copy.deepcopy(separate)
    fuse_siblings(model)
    after = sum(b.nbytes for b in model.buffers())
    # Only the scales from k_proj on are held twice: a few KB, never a second weight copy.
    assert after - before < 0.02 * before
    names = [n for n, _ in model.named_buffers()]
    assert any(n.endswith("gate_up_stacked.packed") for n in names)
    assert not any(n.endswith("up_proj.packed") for n in names)


def test_real_shapes_stack_every_sibling_set():
    # SmolLM2-135M's widths: q 576, k and v 192, gate and up 1536 (two layers of it)
    model = quantize_weights(smollm2_shaped(), "int4")
    assert sum(isinstance(m, ProjectionGroup) for m in model.modules()) == 4
    assert sum(isinstance(m, FusedProjection) for m in model.modules()) == 10


def test_members_called_alone_or_out_of_order_compute_their_own_columns():
    torch.manual_seed(0)
    weights = [torch.randn(n, 64) * 0.1 for n in (128, 64, 64)]
    alone = [qlinear.Int4Linear(qlinear.quantize_int4(w), None) for w in weights]
    group = ProjectionGroup(alone, (0, 1))
    members = [FusedProjection(group, i, n) for i, n in enumerate(("q", "k", "v"))]
    x, y = torch.randn(5, 64), torch.randn(5, 64)
    with torch.inference_mode():
        expected_x = [m(x) for m in alone]
        expected_y = [m(y) for m in alone]
        assert torch.equal(members[0](x), expected_x[0])
        # another input between: k computes from its own columns, not x's leftovers
        assert torch.equal(members[1](y), expected_y[1])
        assert torch.equal(members[2](y), expected_y[2])  # left by k's call on y
        assert torch.equal(members[2](x), expected_x[2])
        assert torch.equal(members[1](x), expected_x[1])


def test_a_group_whose_bits_differ_is_left_unfused(monkeypatch):
    import kvchat.engine.models.fused as fused

    model = unfused("llama", "int4")
    monkeypatch.setattr(fused, "_same_bits", lambda group, members: False)
    assert fuse_siblings(model) == 0
    assert not any(isinstance(m, FusedProjection) for m in model.modules())


def test_float_layers_are_never_stacked():
    model = tiny_model("llama")
    assert fuse_siblings(model) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_still_quantizes_and_runs(family):
    model = quantize_weights(tiny_model(family), "int4")
    tokens, _ = run_conversation(model, DynamicCache(config=model.config))
    assert len(tokens) > 0


@pytest.mark.skipif(not int4_kernel.tiles_available(), reason="no AMX tiles here")
def test_a_prefill_call_tiles_q_proj_columns_and_never_the_replayed_ones():
    """Many rows: the stack's q columns take the tiled path, as q_proj alone does; its k and v
    columns keep the one-row path's bits, so the cache may still replay them in batches."""
    torch.manual_seed(0)
    weights = [torch.randn(n, 64) * 0.1 for n in (128, 64, 64)]
    tiled = [True, False, False]  # what the loader gives q_proj, k_proj, v_proj
    alone = [
        qlinear.Int4Linear(qlinear.quantize_int4(w), None, tiled=t) for w, t in zip(weights, tiled)
    ]
    group = ProjectionGroup(alone, (0, 1))
    members = [FusedProjection(group, i, n) for i, n in enumerate(("q", "k", "v"))]
    assert [m.rows_independent for m in members] == [False, True, True]
    x = torch.randn(int4_kernel.TILED_ROWS + 5, 64)
    with torch.inference_mode():
        got = [m(x) for m in members]
        assert all(torch.equal(g, a(x)) for g, a in zip(got, alone))
        one_row = [torch.cat([a(x[i : i + 1]) for i in range(len(x))]) for a in alone]
    assert not torch.equal(got[0], one_row[0])
    assert torch.equal(got[1], one_row[1]) and torch.equal(got[2], one_row[2])


def test_the_loader_keeps_replayed_projections_off_the_tiles():
    model = unfused("llama", "int4")
    for name, module in model.named_modules():
        if isinstance(module, qlinear.Int4Linear):
            replayed = name.rsplit(".", 1)[-1] in ("k_proj", "v_proj")
            assert module.tiled == (not replayed and int4_kernel.tiles_available()), name
    adapter = ArchAdapter(model)
    assert all(adapter.projects_rows_independently(i) for i in range(adapter.num_layers))
