"""Per-family adapters: how one layer's K/V follow from the residual stream entering it.

For every supported family the adapter replays, op for op, what the model's own attention
module does between ``hidden_states`` (the residual ``h_l`` entering the decoder layer) and
the ``cache.update`` call: input norm, the k/v (or fused qkv) projection, k-norm where the
family has one, and the positional encoding at the token's original position. It calls the
model's own modules and the modeling file's own ``apply_rotary_pos_emb``, so the arithmetic
is the model's, not a re-implementation of it.

Exactness note: ``project`` must be called with exactly the rows of one original forward
call (see ``cache.py``); the projection GEMM's result for a row depends on how many rows the
call had. The exception is a layer whose projections all declare ``rows_independent``
(torch's int8 kernel and kvchat's int4 kernel sum each row in one order for any row
count): ``project`` may then take the rows of several calls at once
(``projects_rows_independently``).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvchat.errors import KvchatError

if TYPE_CHECKING:
    import torch
    from torch import nn

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "gemma3",
    "phi3",
    "gpt2",
)


class UnsupportedArchitectureError(KvchatError, ValueError):
    pass


@dataclass
class LayerSpec:
    """What the cache needs to know about one attention layer."""

    index: int
    sliding_window: int | None  # tokens DynamicCache keeps for this layer (None: all)
    layer_type: str


# RoPE types whose frequencies depend on the longest position of the call (and are kept on
# the shared rotary module): a replayed group could get other frequencies than it had.
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


def _refuse_position_dependent_rope(config: Any) -> None:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    groups = params.values() if isinstance(params, dict) and "rope_type" not in params else [params]
    for group in groups:
        if not isinstance(group, dict):
            continue
        kind = group.get("rope_type") or group.get("type")
        if kind in POSITION_DEPENDENT_ROPE or (kind == "yarn" and group.get("dynamic")):
            raise UnsupportedArchitectureError(
                f"this model's RoPE scaling ({kind}) changes with the context length, so "
                "recomputed K/V could differ from the cached ones; use --cache standard"
            )


def _decoder_backbone(model: nn.Module) -> nn.Module:
    for attr in ("model", "transformer"):
        inner = getattr(model, attr, None)
        if inner is not None:
            # Gemma 3 multimodal: model.model.language_model
            return getattr(inner, "language_model", inner)
    raise UnsupportedArchitectureError(f"cannot find the decoder stack of {type(model).__name__}")


class ArchAdapter:
    """Recomputes a layer's K/V from the residual rows of one original forward call."""

    def __init__(self, model: nn.Module) -> None:
        from transformers.cache_utils import get_layer_types_and_kwargs

        self.model = model
        self.config = model.config.get_text_config(decoder=True)
        self.model_type = self.config.model_type
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"KV-Direct has no adapter for model type '{self.model_type}' "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use --cache standard"
            )
        _refuse_position_dependent_rope(self.config)
        self.backbone = _decoder_backbone(model)
        self.decoder_layers = list(getattr(self.backbone, "layers", None) or self.backbone.h)
        layer_types, kwargs = get_layer_types_and_kwargs(self.config)
        self.layers = [
            LayerSpec(i, kw.get("sliding_window"), lt)
            for i, (lt, kw) in enumerate(zip(layer_types, kwargs))
        ]
        self.is_gpt2 = self.model_type == "gpt2"
        rotary = getattr(self.backbone, "rotary_emb", None)
        self.rotary = rotary
        self._rotary_takes_layer_type = (
            rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        )
        self._rows_independent: dict[int, bool] = {}
        first_attn = self._attention(0)
        self.apply_rope = getattr(
            sys.modules[type(first_attn).__module__], "apply_rotary_pos_emb", None
        )

    # -- module lookup -------------------------------------------------------------------
    def _attention(self, layer_idx: int) -> nn.Module:
        layer = self.decoder_layers[layer_idx]
        return layer.attn if self.is_gpt2 else layer.self_attn

    def attention_module(self, layer_idx: int) -> nn.Module:
        return self._attention(layer_idx)

    def kv_shape(self, layer_idx: int) -> tuple[int, int]:
        """(kv heads, head dim) of layer ``layer_idx``'s K and V."""
        attn = self._attention(layer_idx)
        if self.is_gpt2:
            return attn.num_heads, attn.head_dim
        heads = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        return heads, attn.head_dim

    def _input_norm(self, layer_idx: int) -> nn.Module:
        layer = self.decoder_layers[layer_idx]
        return layer.ln_1 if self.is_gpt2 else layer.input_layernorm

    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers)

    # -- the replay ----------------------------------------------------------------------
    # Three stages, so the cache can batch what is row-independent (norm, k-norm, RoPE:
    # per-row elementwise work and per-row reductions) and replay per original call only
    # the projection GEMM, whose rows depend on the call's row count.
    def normalize(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input norm over ``hidden`` ([1, M, d])."""
        return self._input_norm(layer_idx)(hidden)

    def projects_rows_independently(self, layer_idx: int) -> bool:
        """Whether every module ``project`` runs for the layer computes a row's output
        independently of the other rows of the call (its ``rows_independent`` attribute),
        so that rows of several original calls may be projected in one."""
        known = self._rows_independent.get(layer_idx)
        if known is None:
            attn = self._attention(layer_idx)
            if self.is_gpt2:
                modules = [attn.c_attn]
            elif hasattr(attn, "qkv_proj"):
                modules = [attn.qkv_proj]
            else:
                modules = [attn.k_proj, attn.v_proj]
            known = all(getattr(m, "rows_independent", False) is True for m in modules)
            self._rows_independent[layer_idx] = known
        return known

    def project(self, layer_idx: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw K and V rows ([1, M, kv_heads * head_dim]) of one original call's rows."""
        attn = self._attention(layer_idx)
        if self.is_gpt2:
            _, key, value = attn.c_attn(normed).split(attn.split_size, dim=2)
            return key, value
        if hasattr(attn, "qkv_proj"):  # Phi-3: one fused GEMM, replayed whole for exactness
            qkv = _linear(attn.qkv_proj, normed)
            q_end = self.config.num_attention_heads * attn.head_dim
            kv_end = q_end + attn.num_key_value_heads * attn.head_dim
            return qkv[..., q_end:kv_end], qkv[..., kv_end:]
        return _linear(attn.k_proj, normed), _linear(attn.v_proj, normed)

    def finish(
        self,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Heads split, k-norm, RoPE: ``[1, kv_heads, M, head_dim]`` as ``cache.update`` sees."""
        attn = self._attention(layer_idx)
        shape = (*key.shape[:-1], -1, attn.head_dim)
        key = key.reshape(shape).transpose(1, 2)
        value = value.reshape(shape).transpose(1, 2)
        if self.is_gpt2:
            return key, value
        k_norm = getattr(attn, "k_norm", None)
        if k_norm is not None:
            key = k_norm(key)
        cos, sin = self.rope(layer_idx, hidden, position_ids)
        # The model's own rotary function; its query half is given one head, being unused.
        _, key = self.apply_rope(key[:, :1], key, cos, sin)
        return key, value

    def rope(self, layer_idx: int, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
        """``(cos, sin)`` of the model's own rotary embedding for ``layer_idx``'s layer type."""
        if self._rotary_takes_layer_type:
            return self.rotary(hidden, position_ids, self.layers[layer_idx].layer_type)
        return self.rotary(hidden, position_ids)


def _linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, minus the module-call overhead for a plain ``nn.Linear``.

    ``nn.Linear.forward`` is exactly ``F.linear(x, weight, bias)``; quantized or hooked
    modules keep their own forward.
    """
    import torch.nn.functional as F
    from torch import nn

    if type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks:
        return F.linear(x, module.weight, module.bias)
    return module(x)
