"""Build a model skeleton whose parameters take no memory, buffers real (rotary tables).

The skeleton gets its weights afterwards, one tensor at a time (``quantized_load``, the
GGUF conversion). This is what accelerate's ``init_empty_weights(include_buffers=False)``
does; kvchat keeps its own dozen lines because an installed accelerate is imported by every
``transformers.modeling_utils`` import (RSS the chat process would carry), and the
skeleton was the only thing kvchat used it for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["empty_model", "fill_tensor", "parameters_on_meta"]


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every ``nn.Parameter`` registered inside moves to the meta device as it is registered.

    ``torch.device("meta")`` as a default device would put buffers there too, and a buffer
    computed in ``__init__`` (RoPE's ``inv_freq``) cannot be recovered from a meta tensor.
    Each parameter is allocated for an instant before it moves: one layer's weight at most.
    """
    from torch import nn

    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def empty_model(config: Any, dtype: Any, attn_implementation: str) -> Any:
    """``config``'s causal LM with its parameters on the meta device, ready to be filled one
    tensor at a time; eager attention where the architecture has no SDPA path."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        try:
            return AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn_implementation
            )
        except (ValueError, ImportError) as exc:
            if "sdpa" not in str(exc).lower():
                raise
            return AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation="eager"
            )


def fill_tensor(model: Any, name: str, tensor: Any) -> None:
    """Set the state-dict entry ``name`` of a skeleton to ``tensor``: as a frozen parameter
    where the module has a parameter of that name, else as a buffer."""
    from torch import nn

    parent, _, attr = name.rpartition(".")
    module = model.get_submodule(parent) if parent else model
    if attr in dict(module.named_parameters(recurse=False)):
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
    else:
        module.register_buffer(attr, tensor)
