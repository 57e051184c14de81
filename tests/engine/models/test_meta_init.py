"""The skeleton kvchat builds without accelerate: parameters on meta, buffers computed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from kvchat.engine.models.meta_init import parameters_on_meta
from kvchat.lab.tiny_models import tiny_model


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_parameters_are_meta_and_buffers_equal_a_real_build(family: str) -> None:
    config = tiny_model(family).config
    with parameters_on_meta():
        skeleton = AutoModelForCausalLM.from_config(config)
    real = AutoModelForCausalLM.from_config(config)

    params = dict(skeleton.named_parameters())
    assert params and all(p.device.type == "meta" for p in params.values())
    assert params.keys() == dict(real.named_parameters()).keys()
    buffers = dict(skeleton.named_buffers())
    assert any("inv_freq" in name for name in buffers), "the rotary table is a buffer"
    for name, buffer in real.named_buffers():
        assert buffers[name].device.type == "cpu"
        assert torch.equal(buffers[name], buffer), name


def test_registration_is_restored_even_when_the_build_fails() -> None:
    original = nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="boom"), parameters_on_meta():
        nn.Linear(4, 4)
        raise RuntimeError("boom")
    assert nn.Module.register_parameter is original
    assert nn.Linear(4, 4).weight.device.type == "cpu"


def test_kvchat_never_imports_accelerate() -> None:
    """An installed accelerate is imported by transformers' modeling code in every chat
    process; kvchat neither depends on it nor imports it."""
    from pathlib import Path

    import kvchat

    root = Path(kvchat.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if any(line in path.read_text() for line in ("import accelerate", "from accelerate"))
    ]
    assert offenders == []
    pyproject = (root.parent / "pyproject.toml").read_text()
    assert '"accelerate' not in pyproject
