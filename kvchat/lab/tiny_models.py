"""Tiny random models of every family KV-Direct supports, built from configs.

They cover many architectures in milliseconds; the real-model tests carry the weight of
evidence (SmolLM2-135M, Gemma 3 270M).
"""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=256, max_position_embeddings=1024, tie_word_embeddings=False)


def _config(family: str):
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            **COMMON,
        )
    if family == "mistral":
        return tf.MistralConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=24,
            head_dim=16,
            **COMMON,
        )
    if family == "qwen2":
        return tf.Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            **COMMON,
        )
    if family == "qwen3":
        return tf.Qwen3Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            **COMMON,
        )
    if family == "gemma3":
        return tf.Gemma3TextConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=24,
            query_pre_attn_scalar=16,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            **COMMON,
        )
    if family == "phi3":
        return tf.Phi3Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            pad_token_id=0,
            bos_token_id=1,  # the defaults (1, 32000) point outside this tiny vocabulary
            eos_token_id=2,
            **COMMON,
        )
    if family == "gpt2":
        return tf.GPT2Config(
            n_embd=64,
            n_layer=3,
            n_head=4,
            n_positions=1024,
            vocab_size=256,
            bos_token_id=1,  # the default 50256 points outside this tiny vocabulary
            eos_token_id=2,
        )
    raise ValueError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "gpt2")


def tiny_model(
    family: str, dtype: torch.dtype = torch.float32, seed: int = 0, *, kvchat_attention: bool = True
):
    """A tiny random model of ``family``. With ``kvchat_attention`` (the default) it runs
    kvchat's attention, as every model kvchat loads does, so every cache on it sums
    attention in one order; without it, transformers' own SDPA (a reference to compare
    kvchat's tokens with)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _config(family)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    # Random init gives near-uniform logits and ties; widen them so greedy is meaningful.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    if kvchat_attention:
        from kvchat.engine.kvdirect.attention import route

        route(model)
    return model
