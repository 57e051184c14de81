"""Eviction baselines: each policy holds its budget, keeps the tokens its paper says, and is
the standard cache when nothing has to go.

Three kinds of check, all on tiny random models:

* policy units: a single cache layer fed hand-made K/V and attention weights, so what each
  policy keeps can be read off the numbers (H2O's accumulated scores, TOVA's argmin,
  SnapKV's vote);
* mechanics: a policy's run equals an unbounded ``DynamicCache`` run in which attention is
  masked, per layer and per head, to the positions the policy held (so the gathers, the
  per-head masks and the sliding windows are right);
* limits: with a budget >= the context every policy is ``DynamicCache``, bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvchat.engine.chat.generate import forward, prefill
from kvchat.engine.kvdirect.arch import ArchAdapter, UnsupportedArchitectureError
from kvchat.lab.baselines import (
    POLICIES,
    EvictionCache,
    H2OLayer,
    SnapKVLayer,
    TOVALayer,
    WindowLayer,
)
from kvchat.lab.tiny_models import tiny_model

CPU = torch.device("cpu")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")


def eager(family: str):
    model = tiny_model(family)
    model.set_attn_implementation("eager")
    return model


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, cache, ids, n_new=12, chunk=16, after_step=None):
    """Chunked prefill, ``end_prefill``, greedy decode; logits of every step."""
    logits_seen = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            logits = forward(model, cache, ids[start : start + chunk], CPU)
            if after_step:
                after_step("prefill")
        if hasattr(cache, "end_prefill"):
            cache.end_prefill()
            if after_step:
                after_step("end")
        logits_seen.append(logits.clone())
        for _ in range(n_new):
            logits = forward(model, cache, [int(logits.argmax())], CPU)
            logits_seen.append(logits.clone())
            if after_step:
                after_step("decode")
    return logits_seen


# -- limits ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_budget_at_least_the_context_is_the_standard_cache(family):
    model = eager(family)
    ids = prompt(50)
    ref = run(model, DynamicCache(config=model.config), ids)
    for policy in POLICIES:
        with EvictionCache(model, policy, budget=1000) as cache:
            got = run(model, cache, ids)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), f"{family} {policy}"
        assert sum(layer.evicted_tokens for layer in cache.layers) == 0


def test_gpt2_is_not_supported():
    with pytest.raises(UnsupportedArchitectureError):
        EvictionCache(tiny_model("gpt2"), "window", 8)


def test_score_policies_need_hooks_and_eager_attention():
    model = eager("llama")
    cache = EvictionCache(model, "h2o", 8)  # not attached
    with pytest.raises(RuntimeError, match="attach"):
        run(model, cache, prompt(20), n_new=0)
    sdpa = tiny_model("llama")
    with pytest.raises(RuntimeError, match="eager"), EvictionCache(sdpa, "tova", 8) as cache:
        run(sdpa, cache, prompt(20), n_new=0)


# -- budget ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("policy", POLICIES)
def test_each_layer_holds_exactly_its_budget(family, policy):
    model = eager(family)
    budget = 10
    cache = EvictionCache(model, policy, budget)
    decoded = 0

    def check(phase: str) -> None:
        nonlocal decoded
        n = cache.get_seq_length()
        for layer in cache.layers:
            visible = n if layer.sliding_window is None else min(n, layer.sliding_window - 1)
            if policy == "snapkv":
                if phase == "prefill":  # SnapKV holds the prompt until it ends
                    expected = visible
                else:  # then B, plus every decoded token (but what a window hides)
                    decoded += phase == "decode" and layer.layer_idx == 0
                    expected = min(budget + decoded, visible)
            else:
                expected = min(budget, visible)
            assert layer.held == expected, f"{phase} layer {layer.layer_idx} at {n}"
            assert (layer.positions >= 0).all(), "no empty slots expected here"

    with cache:
        run(model, cache, prompt(45), n_new=8, after_step=check)


# -- which tokens ------------------------------------------------------------------------


def test_window_keeps_the_last_budget_tokens():
    model = eager("llama")
    with EvictionCache(model, "window", 7) as cache:
        run(model, cache, prompt(40), n_new=5)
    n = cache.get_seq_length()
    for layer in cache.layers:
        assert layer.held_positions() == [list(range(n - 7, n))] * 2


def test_streaming_llm_keeps_four_sinks_and_the_recent_window():
    model = eager("gemma3")  # layers 0, 1, 3 sliding (window 24), layer 2 global
    with EvictionCache(model, "streaming_llm", 12) as cache:
        run(model, cache, prompt(40), n_new=5)
    n = cache.get_seq_length()
    for layer in cache.layers:
        if layer.is_sliding:  # the sinks are outside what a sliding layer can see
            assert layer.held_positions() == [list(range(n - 12, n))]
        else:
            assert layer.held_positions() == [[0, 1, 2, 3, *range(n - 8, n)]]


def test_streaming_llm_gives_the_sinks_their_position_in_the_cache():
    """Layer 0's K of a token depends only on the token and its position: a sink key handed
    to attention must be the key the token would have at its in-cache position shifted by
    the tokens evicted after the sinks (the paper's positions within the cache)."""
    model = eager("llama")
    ids = prompt(40)
    cache = EvictionCache(model, "streaming_llm", 12)
    layer0 = cache.layers[0]
    seen = {}
    original = layer0.update

    def spy(k, v, *a, **kw):
        seen["shift"] = layer0.sink_shift()  # what the step attends with (it evicts after)
        out = original(k, v, *a, **kw)
        seen["keys"] = out[0]
        return out

    layer0.update = spy
    with cache:
        run(model, cache, ids, n_new=3)
    shift = seen["shift"]
    assert shift == cache.get_seq_length() - 1 - 8 - 4  # 8 recent + the new token held
    adapter = ArchAdapter(model)
    with torch.inference_mode():
        hidden = model.model.embed_tokens(torch.tensor([ids[:4]]))
        key, value = adapter.project(0, adapter.normalize(0, hidden))
        positions = torch.arange(shift, shift + 4)[None]
        expected, _ = adapter.finish(0, key, value, hidden, positions)
    assert torch.allclose(seen["keys"][..., :4, :], expected, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(layer0.keys[..., :4, :], expected, atol=1e-3)  # stored unmoved


def _layer(cls, budget, kv_heads=2, head_dim=4, **kw):
    layer = cls(SimpleNamespace(attached=True), 0, budget, None, **kw)
    kv = torch.zeros(1, kv_heads, 0, head_dim)
    layer.lazy_initialization(kv, kv)
    return layer


def _feed(layer, n, weights=None):
    kv_heads, head_dim = layer.keys.shape[1], layer.keys.shape[-1]
    start = layer.cumulative_length
    # each token's K/V carry its position, to check the gathers
    kv = torch.arange(start, start + n, dtype=torch.float32)[None, None, :, None]
    kv = kv.expand(1, kv_heads, n, head_dim)
    layer.update(kv, kv.clone())
    if weights is not None:
        layer.observe(weights)
    # the K/V rows follow their positions through every gather
    held = layer.positions
    assert torch.equal(layer.keys[0, :, :, 0], held.float())


def test_window_layer_unit():
    layer = _layer(WindowLayer, 3)
    _feed(layer, 5)
    assert layer.held_positions() == [[2, 3, 4]] * 2


def test_h2o_keeps_heavy_hitters_by_accumulated_attention_per_head():
    # 4 query heads over 2 KV heads; budget 4 = 2 heavy hitters + 2 recent.
    layer = _layer(H2OLayer, 4)
    w = torch.zeros(1, 4, 6, 6)
    w[0, 0, :, 1] = 0.5  # KV head 0 (query heads 0, 1): tokens 1 and 3
    w[0, 1, :, 3] = 0.4
    w[0, 2, :, 0] = 0.3  # KV head 1 (query heads 2, 3): tokens 0 and 2
    w[0, 3, :, 2] = 0.2
    w[0, :, :, 5] = 0.1
    _feed(layer, 6, w)
    assert layer.held_positions() == [[1, 3, 4, 5], [0, 2, 4, 5]]
    assert torch.allclose(layer.scores[0], torch.tensor([3.0, 2.4, 0.0, 1.2], dtype=torch.float64))
    # Next token: position 4 leaves the recent window (now 5, 6) and competes on its
    # accumulated score: on KV head 0 it beats token 3 (2.4) with 2.5, on head 1 it does not.
    w = torch.zeros(1, 4, 1, 5)
    w[0, 0, 0, 2] = 1.5  # slot 2 = position 4
    w[0, 1, 0, 2] = 1.0
    w[0, 2, 0, 2] = 0.1
    _feed(layer, 1, w)
    assert layer.held_positions() == [[1, 4, 5, 6], [0, 2, 5, 6]]


def test_tova_drops_the_lowest_head_averaged_attention_of_the_last_query():
    layer = _layer(TOVALayer, 3)
    w = torch.zeros(1, 4, 4, 4)
    w[0, :, :3, 1] = 1.0  # earlier queries do not count
    # last query: each head's own argmin is another token; the average's (0.2) is token 1
    w[0, :, -1] = torch.tensor(
        [[0.0, 0.2, 0.4, 0.4], [0.4, 0.2, 0.0, 0.4], [0.4, 0.2, 0.4, 0.0], [0.4, 0.2, 0.3, 0.1]]
    )
    _feed(layer, 4, w)
    assert layer.held_positions() == [[0, 2, 3]] * 2
    w = torch.zeros(1, 4, 1, 4)
    w[0, :, 0] = torch.tensor([0.5, 0.1, 0.3, 0.2])  # slots: positions 0, 2, 3, new 4
    _feed(layer, 1, w)
    assert layer.held_positions() == [[0, 3, 4]] * 2


def test_snapkv_votes_with_the_observation_window_per_head():
    layer = _layer(SnapKVLayer, 4, window=2, kernel_size=1)
    w = torch.zeros(1, 4, 8, 8)
    w[0, :, :6, 0] = 5.0  # rows outside the observation window do not vote
    w[0, 0, 6:, 1] = 0.6  # KV head 0 = mean of query heads 0, 1
    w[0, 1, 6:, 3] = 0.5
    w[0, 1, 6:, 2] = 0.05
    w[0, 2, 6:, 4] = 0.4  # KV head 1
    w[0, 3, 6:, 5] = 0.3
    _feed(layer, 8, w)
    assert layer.held == 8  # nothing goes before the prefill ends
    layer.end_prefill()
    assert layer.held_positions() == [[1, 3, 6, 7], [4, 5, 6, 7]]
    _feed(layer, 1, torch.full((1, 4, 1, 5), 0.2))
    assert layer.held_positions() == [[1, 3, 6, 7, 8], [4, 5, 6, 7, 8]]  # decoded: all kept


def test_snapkv_pools_scores_before_choosing():
    layer = _layer(SnapKVLayer, 2, kv_heads=1, window=1, kernel_size=3)
    w = torch.zeros(1, 1, 6, 6)
    w[0, 0, -1] = torch.tensor([0.0, 0.25, 0.3, 0.0, 0.3, 0.15])
    _feed(layer, 6, w)
    layer.end_prefill()
    # Raw votes would pick token 2 or 4 (0.3). Avg-pooled with k=3 (the window's own vote
    # left out): 1 -> 0.183, 2 -> 0.183, 3 -> 0.2, 4 -> 0.1: the gap between two strong
    # tokens wins, and the window (token 5) is kept.
    assert layer.held_positions() == [[3, 5]]


def test_snapkv_selection_is_the_papers_on_a_model():
    """End of a chunked prefill (last chunk shorter than the window): the kept tokens are
    those the paper's algorithm picks from the full prompt's attention."""
    model = eager("llama")
    ids = prompt(61)
    window, budget = 8, 20
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([ids]),
            cache=DynamicCache(config=model.config),
            output_attentions=True,
        )
        cache = EvictionCache(model, "snapkv", budget, window=window)
        with cache:
            prefill(model, cache, ids, CPU, 20)  # chunks 20, 20, 20, 1
            cache.end_prefill()
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    for idx, attention in enumerate(out.attentions):
        votes = attention[0, :, -window:, :-window].double().sum(dim=1)  # [heads, prefix]
        pooled = F.avg_pool1d(votes[:, None], 5, stride=1, padding=2)[:, 0]
        pooled = pooled.view(-1, group, pooled.shape[-1]).mean(dim=1)
        top = pooled.topk(budget - window, dim=-1).indices.sort(dim=-1).values
        expected = [row + list(range(61 - window, 61)) for row in top.tolist()]
        assert cache.layers[idx].held_positions() == expected, f"layer {idx}"


# -- mechanics ---------------------------------------------------------------------------


def _masked_reference(model, policy_cache, ref_cache, snapshot):
    """Pre-hooks that mask the reference's attention to what the policy held, per head."""
    heads = model.config.num_attention_heads
    hooks = []
    for idx, module in enumerate(policy_cache.adapter.decoder_layers):

        def hook(mod, args, kwargs, idx=idx):
            n = kwargs["hidden_states"].shape[1]
            start = snapshot["start"]
            ref_layer = ref_cache.layers[idx] if idx < len(ref_cache.layers) else None
            initialized = ref_layer is not None and ref_layer.is_initialized
            ref_held = ref_layer.keys.shape[-2] if initialized else 0
            kv = torch.arange(start - ref_held, start + n)  # what the reference attends over
            q = torch.arange(start, start + n)
            keep = torch.stack([torch.isin(kv, row[row >= 0]) for row in snapshot[idx]])
            keep |= kv >= start
            allowed = keep[:, None, :] & (kv <= q[:, None])
            window = policy_cache.layers[idx].sliding_window
            if window:
                allowed &= kv > q[:, None] - window
            allowed = allowed.repeat_interleave(heads // allowed.shape[0], dim=0)
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
            kwargs["attention_mask"] = mask[None]
            return args, kwargs

        hooks.append(module.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    return hooks


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral"])
@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_equals_masking_the_unbounded_cache(family, policy):
    """Dropping K/V is attention masked to what is held (StreamingLLM with original
    positions here: its in-cache positions are checked on their own above)."""
    model = eager(family)
    options = {"streaming_llm": {"reposition": False}, "snapkv": {"window": 4}}.get(policy, {})
    cache = EvictionCache(model, policy, 12, **options)
    reference = DynamicCache(config=model.config)
    snapshot: dict = {}
    worst = 0.0

    def step(ids):
        nonlocal worst
        snapshot["start"] = cache.get_seq_length()
        for i, layer in enumerate(cache.layers):
            empty = torch.empty((1, 0), dtype=torch.long)
            snapshot[i] = layer.positions.clone() if layer.positions is not None else empty
        with cache:
            ours = forward(model, cache, ids, CPU)
        hooks = _masked_reference(model, cache, reference, snapshot)
        try:
            theirs = forward(model, reference, ids, CPU)
        finally:
            for h in hooks:
                h.remove()
        worst = max(worst, float((ours - theirs).abs().max() / theirs.abs().max()))
        return ours

    ids = prompt(60, seed=1)
    with torch.inference_mode():
        for start in range(0, len(ids), 16):
            logits = step(ids[start : start + 16])
        cache.end_prefill()
        for _ in range(10):
            logits = step([int(logits.argmax())])
    assert sum(layer.evicted_tokens for layer in cache.layers) > 0
    assert worst < 1e-5


def test_fork_is_independent():
    model = eager("llama")
    ids = prompt(40)
    with torch.inference_mode():
        cache = EvictionCache(model, "h2o", 10)
        with cache:
            prefill(model, cache, ids, CPU, 16)
        twin = cache.fork()
        before = [layer.positions.clone() for layer in cache.layers]
        with twin:
            for token in (5, 6, 7):
                forward(model, twin, [token], CPU)
        assert all(torch.equal(a, b.positions) for a, b in zip(before, cache.layers))
        with cache:
            a = forward(model, cache, [9], CPU)
        fresh = EvictionCache(model, "h2o", 10)
        with fresh:
            prefill(model, fresh, ids, CPU, 16)
            b = forward(model, fresh, [9], CPU)
    assert torch.equal(a, b)
