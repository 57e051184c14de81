"""Decode steps on one thread, prefill on two: a replay still matches its original call.

At SmolLM2's widths an fp32 projection of 7 rows gives other bits on one thread than on two
(one row does not). A chunk of 7 rows prefilled on two threads and replayed from its
residuals inside a one-row decode step (one thread) must still give the cached bits: the
replay runs under the count of its original call (``kvchat.threads.rows_threads``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvchat.engine.chat.generate import forward, prefill
from kvchat.engine.kvdirect.arch import ArchAdapter
from kvchat.engine.kvdirect.cache import KVDirectCache
from kvchat.threads import apply_threads, set_decode_threads, threads_for_rows

CHUNK = 7


@pytest.fixture
def one_thread_decode():
    before = torch.get_num_threads()
    apply_threads(2)
    set_decode_threads(1)
    yield
    set_decode_threads(None)
    apply_threads(before)


def smollm2_shaped() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def converse(model, cache) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    seen, pending = [], []
    with torch.inference_mode():
        for _turn in range(3):
            user = torch.randint(0, 512, (2 * CHUNK,), generator=gen).tolist()
            logits = prefill(model, cache, pending + user, torch.device("cpu"), CHUNK)
            seen.append(logits.clone())
            for _ in range(4):
                logits = forward(model, cache, [int(logits.argmax())], torch.device("cpu"))
                seen.append(logits.clone())
            pending = [int(logits.argmax())]
    return seen


def test_the_kernel_really_depends_on_the_thread_count_here():
    torch.manual_seed(0)
    w, x = torch.randn(192, 576), torch.randn(CHUNK, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = F.linear(x, w)
        torch.set_num_threads(2)
        two = F.linear(x, w)
    finally:
        torch.set_num_threads(before)
    if torch.equal(one, two):
        pytest.skip("this CPU's GEMM gives the same bits on 1 and 2 threads")


def test_single_rows_take_the_decode_count(one_thread_decode):
    assert threads_for_rows(1) == 1
    assert threads_for_rows(CHUNK) == 2


def test_replays_across_thread_counts_are_exact(one_thread_decode):
    model = smollm2_shaped()
    reference = converse(model, DynamicCache(config=model.config))
    adapter = ArchAdapter(model)
    cache = KVDirectCache(adapter, ["residual"] * adapter.num_layers, hot_window=2).attach()
    got = converse(model, cache)
    assert cache.stats.recomputed_tokens > 0
    cache.detach()
    assert all(torch.equal(a, b) for a, b in zip(got, reference))
