"""KV-Direct is exact: same greedy tokens, same logits, same K/V as the unbounded cache.

Every family, every hot window B in {1, 4, 16, 64, half, all}, three turns whose lengths
straddle B and the sliding window, prefilled in chunks, 64+ new tokens in all.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import DynamicCache

from kvchat.engine.chat.generate import forward, prefill
from kvchat.engine.kvdirect.arch import ArchAdapter
from kvchat.engine.kvdirect.cache import KVDirectCache
from kvchat.lab.tiny_models import FAMILIES
from kvchat.lab.tiny_models import tiny_model as _tiny_model

TURN_LENGTHS = (40, 23, 9)  # user turns, in tokens
NEW_PER_TURN = 22  # 66 generated in all
CHUNK = 16


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A tiny model on the device the run asked for (``pytest --device cuda``)."""
    return _tiny_model(family, dtype, seed).to(os.environ.get("KVCHAT_TEST_DEVICE", "cpu"))


def run_conversation(
    model,
    cache,
    *,
    seed: int = 1,
    new_per_turn: int = NEW_PER_TURN,
    turn_lengths: tuple[int, ...] = TURN_LENGTHS,
    chunk: int = CHUNK,
):
    """Turns of random 'user' tokens, greedy replies; returns tokens and logits."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    device = next(model.parameters()).device
    tokens, logits_seen = [], []
    pending: list[int] = []
    with torch.inference_mode():
        for n_user in turn_lengths:
            user = torch.randint(0, vocab, (n_user,), generator=gen).tolist()
            logits = prefill(model, cache, pending + user, device, chunk)
            logits_seen.append(logits.clone())
            for step in range(new_per_turn):
                token = int(torch.argmax(logits))
                tokens.append(token)
                if step == new_per_turn - 1:
                    pending = [token]  # fed first next turn, as the engine does
                    break
                logits = forward(model, cache, [token], device)
                logits_seen.append(logits.clone())
    return tokens, logits_seen


def budgets(total: int) -> list[int | None]:
    return [1, 4, 16, 64, total // 2, None]


def kvdirect(model, hot_window, form="residual"):
    adapter = ArchAdapter(model)
    return KVDirectCache(adapter, [form] * adapter.num_layers, hot_window).attach()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_budget_matches_standard_cache(family):
    model = tiny_model(family)
    ref_tokens, ref_logits = run_conversation(model, DynamicCache(config=model.config))
    total = sum(TURN_LENGTHS) + len(TURN_LENGTHS) * NEW_PER_TURN
    for hot in budgets(total):
        cache = kvdirect(model, hot)
        tokens, logits = run_conversation(model, cache)
        cache.detach()
        assert tokens == ref_tokens, f"{family} B={hot}: greedy tokens differ"
        assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits)), (
            f"{family} B={hot}: logits not bit-identical"
        )
        if hot is not None and hot < 64:
            assert cache.stats.recomputed_tokens > 0, "nothing was recomputed: test is vacuous"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_recomputed_kv_equal_the_cached_kv(family, dtype):
    """Per layer, K/V rebuilt from checkpoints are torch.equal to DynamicCache's."""
    model = tiny_model(family, dtype)
    standard = DynamicCache(config=model.config)
    run_conversation(model, standard)
    cache = kvdirect(model, hot_window=4)
    run_conversation(model, cache)
    cache.detach()
    checked = 0
    for idx, (ours, ref) in enumerate(zip(cache.layers, standard.layers)):
        n = ours.cumulative_length
        hot_from = n - ours.hot_length
        if ours.is_sliding:
            # DynamicCache keeps window - 1 tokens; compare the cold ones among them.
            begin = n - ref.keys.shape[-2]
            ref_k, ref_v = ref.keys, ref.values
        else:
            begin = 0
            ref_k, ref_v = ref.keys, ref.values
        k, v = ours.cold_kv(begin, hot_from)
        assert torch.equal(k, ref_k[..., : hot_from - begin, :]), f"layer {idx} K"
        assert torch.equal(v, ref_v[..., : hot_from - begin, :]), f"layer {idx} V"
        assert torch.equal(ours.keys, ref_k[..., hot_from - begin :, :]), f"layer {idx} hot K"
        checked += hot_from - begin
    assert checked > 0


def test_naive_batched_recompute_is_not_exact_here():
    """Why the replay exists: one batched GEMM over all rows differs from M=1 calls (CPU fp32)."""
    torch.manual_seed(0)
    weight = torch.randn(256, 640) * 0.05
    rows = torch.randn(40, 640)
    one_by_one = torch.cat([torch.nn.functional.linear(rows[i : i + 1], weight) for i in range(40)])
    batched = torch.nn.functional.linear(rows, weight)
    if torch.equal(one_by_one, batched):
        pytest.skip("this CPU/BLAS gives row results independent of M")
    assert (one_by_one - batched).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3", "gpt2"])
def test_checkpoint_forms_kv_and_auto_are_exact(family):
    model = tiny_model(family)
    ref_tokens, ref_logits = run_conversation(model, DynamicCache(config=model.config))
    adapter = ArchAdapter(model)
    from kvchat.engine.kvdirect.footprint import footprint_from_config
    from kvchat.engine.kvdirect.planner import choose_forms

    fp = footprint_from_config(model.config, "float32")
    for checkpoint in ("kv", "auto"):
        forms = choose_forms(fp, checkpoint)
        cache = KVDirectCache(adapter, forms, hot_window=4).attach()
        tokens, logits = run_conversation(model, cache)
        cache.detach()
        assert tokens == ref_tokens
        assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
        if checkpoint == "kv":
            assert cache.checkpoint_bytes() == 0 and cache.stats.recomputed_tokens == 0
    if family in ("phi3", "gpt2"):  # MHA: residual is the smaller exact form
        assert set(choose_forms(fp, "auto")) == {"residual"}
    else:
        assert set(choose_forms(fp, "auto")) == {"kv"}
