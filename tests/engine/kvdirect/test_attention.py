"""Which attention a routed model's call runs: the question a decode step asks before it
calls the exact kernel itself (``takes_exact_kernel``) has the routed function's answer."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvchat.engine.kvdirect import exact_attention
from kvchat.engine.kvdirect.arch import ArchAdapter
from kvchat.engine.kvdirect.attention import (
    PREFIX,
    install,
    set_pending_stream,
    takes_exact_kernel,
)
from tests.engine.kvdirect.test_cache_exact import tiny_model

pytestmark = pytest.mark.skipif(
    not exact_attention.available(), reason="no exact attention kernel here"
)


def _routed_module(attention: str = "sdpa"):
    """An attention module of a tiny model routed from ``attention``, and the attention
    function its model's calls run."""
    model = tiny_model("llama")
    adapter = ArchAdapter(model)
    modules = [adapter.attention_module(i) for i in range(adapter.num_layers)]
    model.config._attn_implementation = attention
    install(modules)
    assert model.config._attn_implementation == PREFIX + attention
    return ALL_ATTENTION_FUNCTIONS[PREFIX + attention], modules[1]


def test_a_plain_decode_call_takes_the_kernel():
    function, module = _routed_module()
    query = torch.randn(1, 4, 1, 16)
    assert takes_exact_kernel(function, module, query, None, 9, None)


def test_calls_the_routed_function_sends_elsewhere_do_not():
    function, module = _routed_module()
    query = torch.randn(1, 4, 1, 16)
    # a padding mask: not the causal pattern the kernel computes from positions
    padded = torch.zeros(1, 1, 1, 9, dtype=torch.bool)
    assert not takes_exact_kernel(function, module, query, padded, 9, None)
    # two sequences at once
    assert not takes_exact_kernel(function, module, torch.randn(2, 4, 1, 16), None, 9, None)
    # a model routed from eager attention keeps eager (callers read its weights)
    assert not takes_exact_kernel(*_routed_module("eager"), query, None, 9, None)
    # the model's own attention function, not kvchat's
    assert not takes_exact_kernel(ALL_ATTENTION_FUNCTIONS["sdpa"], module, query, None, 9, None)


def test_a_layer_left_pending_for_streamed_attention_does_not():
    function, module = _routed_module()
    query = torch.randn(1, 4, 1, 16)
    other = types.SimpleNamespace(layer_idx=module.layer_idx + 1, pending_cold=[1])
    mine = types.SimpleNamespace(layer_idx=module.layer_idx, pending_cold=[1])
    try:
        set_pending_stream(other)
        assert takes_exact_kernel(function, module, query, None, 9, None)
        set_pending_stream(mine)
        assert not takes_exact_kernel(function, module, query, None, 9, None)
    finally:
        set_pending_stream(None)
