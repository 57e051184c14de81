"""Every rope key llama.cpp reads from a GGUF reaches the converted config.

transformers' GGUF loader maps ``rope.freq_base`` only: a Gemma-3-4B GGUF's x8 linear
scaling of its global layers (``gemma3.rope.scaling.*``) and its sliding layers' base
(``rope.freq_base_swa``) were dropped, so the converted model was another model. These
tests write real GGUF headers with gguf's own writer and read them the way conversion does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter, RopeScalingType

from kvchat.engine.models.gguf import rope_overrides


def write_gemma3_header(path: Path, scaling: RopeScalingType | None, factor: float = 8.0) -> None:
    w = GGUFWriter(str(path), "gemma3")
    w.add_context_length(131072)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(32)
    w.add_value_length(32)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(16)
    w.add_rope_freq_base(1_000_000.0)
    w.add_rope_freq_base_swa(10_000.0)
    if scaling is not None:
        w.add_rope_scaling_type(scaling)
        w.add_rope_scaling_factor(factor)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_linear_scaling_and_the_sliding_base_reach_the_config(tmp_path):
    from transformers import AutoConfig

    gguf = tmp_path / "gemma.gguf"
    write_gemma3_header(gguf, RopeScalingType.LINEAR)
    overrides = rope_overrides(gguf)
    assert overrides == {
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    }
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=gguf.name, **overrides)
    full = config.rope_parameters["full_attention"]
    assert full["rope_type"] == "linear" and full["factor"] == 8.0
    assert full["rope_theta"] == 1_000_000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    # Without the overrides, transformers alone drops the scaling: the bug this fixes.
    plain = AutoConfig.from_pretrained(tmp_path, gguf_file=gguf.name)
    assert "factor" not in str(plain.rope_parameters)


@pytest.mark.parametrize("scaling", [None, RopeScalingType.NONE])
def test_no_scaling_keeps_both_bases(tmp_path, scaling):
    from transformers import AutoConfig

    gguf = tmp_path / "gemma.gguf"
    write_gemma3_header(gguf, scaling)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=gguf.name, **rope_overrides(gguf))
    assert config.rope_parameters["full_attention"] == {"rope_type": "default", "rope_theta": 1e6}
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
