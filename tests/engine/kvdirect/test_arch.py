"""Architectures the replay cannot make exact are refused, not approximated."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvchat.engine.kvdirect.arch import ArchAdapter, UnsupportedArchitectureError
from kvchat.lab.tiny_models import tiny_model


def llama_with_rope(rope: dict):
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_parameters={"rope_theta": 10000.0, **rope},
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize(
    "rope",
    [{"rope_type": "dynamic", "factor": 2.0}],
)
def test_rope_that_depends_on_the_context_length_is_refused(rope):
    with pytest.raises(UnsupportedArchitectureError, match="--cache standard"):
        ArchAdapter(llama_with_rope(rope))


def test_fixed_rope_scaling_is_accepted():
    ArchAdapter(llama_with_rope({"rope_type": "linear", "factor": 2.0}))
    ArchAdapter(tiny_model("llama", torch.float32, 0))
