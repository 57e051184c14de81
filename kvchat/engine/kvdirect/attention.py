"""Which attention a model's layers run while kvchat drives it, on every cache.

:func:`install` registers one attention function with transformers' ``AttentionInterface``
under ``kvdirect_<original>`` and points the model's configs at it, once per model. The
function runs, in order of preference:

1. a streamed layer's attention, when the cache's ``update`` for this layer left cold
   positions for attention to fetch, or handed them over already read, apart from the hot
   rows (:func:`pending_stream`; ``streamed_attention.py``);
2. kvchat's exact kernel (``exact_attention.py``) for ordinary calls on the CPU, so the
   standard cache, the bounded cache's whole K/V and its streamed windows all sum in one
   order and give the same bits;
3. the model's own attention otherwise (another device, a soft cap, a padding mask, or
   a model in eager attention: callers choose eager to read the attention weights, which
   only it returns; ``kvchat bench``'s eviction baselines do).

The cache hands a streamed layer over through a context variable set in ``update`` and
read by the attention call that follows it in the same thread: nothing is planted on
transformers' modules, and two caches on one model never see each other's layers.
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Any

from kvchat.engine.kvdirect import exact_attention

PREFIX = "kvdirect_"

__all__ = [
    "PREFIX",
    "install",
    "installed",
    "pending_stream",
    "route",
    "set_pending_stream",
    "takes_exact_kernel",
]

# Models route() has seen: routed ones (a model switched to another attention afterwards,
# by set_attn_implementation, is not routed again behind the caller's back), and ones with
# no KV-Direct adapter, whose own attention serves.
_routed: weakref.WeakSet = weakref.WeakSet()
_unroutable: weakref.WeakSet = weakref.WeakSet()

_pending: contextvars.ContextVar[Any] = contextvars.ContextVar("kvchat_stream", default=None)


def set_pending_stream(layer: Any) -> None:
    """Called by a cache layer whose ``update`` left cold positions for attention."""
    _pending.set(layer)


def _pending_for(layer_idx: int) -> Any:
    """The layer left pending for ``layer_idx``, else None (it stays pending)."""
    layer = _pending.get()
    if layer is None or layer.layer_idx != layer_idx or layer.pending_cold is None:
        return None
    return layer


def pending_stream(layer_idx: int) -> Any:
    """The layer left pending for ``layer_idx`` (and forget it), else None."""
    layer = _pending_for(layer_idx)
    if layer is not None:
        _pending.set(None)
    return layer


def takes_exact_kernel(
    attention_function: Any,
    module: Any,
    query: Any,
    attention_mask: Any,
    n_keys: int,
    window: int | None,
) -> bool:
    """Whether ``attention_function`` (what the model's attention interface holds for its
    implementation) would hand this call, with the K/V the cache's ``update`` just
    returned, straight to :func:`exact_attention.exact_attention`: it is kvchat's, routed
    from a non-eager attention, no streamed layer is pending for the module, and the kernel
    is usable. A decode step that can call the kernel itself asks this first."""
    if not getattr(attention_function, "exact_kernel_first", False):
        return False
    if _pending_for(module.layer_idx) is not None:
        return False
    return exact_attention.usable(module, query, attention_mask, n_keys, window)


def _configs(modules: list[Any]) -> list[Any]:
    configs: list[Any] = []
    for module in modules:
        if all(module.config is not c for c in configs):
            configs.append(module.config)
    return configs


def installed(config: Any) -> bool:
    return str(getattr(config, "_attn_implementation", "") or "").startswith(PREFIX)


def route(model: Any, adapter: Any = None) -> None:
    """Route ``model``'s attention through kvchat's, once: loading, the caches and the
    forward loop all call this, and after the first call it is a set lookup. ``adapter``:
    the model's ``ArchAdapter`` when the caller has one."""
    if model in _routed or model in _unroutable:
        return
    from kvchat.engine.kvdirect.arch import ArchAdapter, UnsupportedArchitectureError

    try:
        adapter = adapter or ArchAdapter(model)
    except UnsupportedArchitectureError:
        _unroutable.add(model)
        return
    install([adapter.attention_module(i) for i in range(adapter.num_layers)])
    _routed.add(model)


def install(attention_modules: list[Any]) -> None:
    """Route these attention modules (all of a model's) through kvchat's attention.
    Idempotent; the model's own implementation stays reachable for calls the exact kernel
    does not take."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    configs = _configs(attention_modules)
    original = configs[0]._attn_implementation or "eager"
    if original.startswith(PREFIX):
        return
    name = PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS:
        inner = None if original == "eager" else ALL_ATTENTION_FUNCTIONS[original]

        def attention(module: Any, query, key, value, attention_mask, **kwargs):
            from kvchat.engine.kvdirect.streamed_attention import streamed_attention

            scaling = kwargs.get("scaling")
            if scaling is None:
                scaling = query.shape[-1] ** -0.5
            window = exact_attention.window_of(module, kwargs)
            layer = pending_stream(module.layer_idx)
            if layer is not None:
                args = (layer, module, query, key, value, attention_mask, scaling, window)
                if layer.held_cold is None:
                    return streamed_attention(*args), None
                n_keys = layer.held_cold[0].shape[-2] + key.shape[-2]
                if inner is not None and exact_attention.usable(
                    module, query, attention_mask, n_keys, window
                ):
                    return streamed_attention(*args, exact=True), None
                # Only the exact kernel folds the held rows apart with the same bits.
                key, value = layer.join_held(key, value)
            if inner is not None and exact_attention.usable(
                module, query, attention_mask, key.shape[-2], window
            ):
                out = exact_attention.exact_attention(query, key, value, scaling, window)
                return out, None
            if key.dtype != query.dtype:
                # K/V held narrower than the model computes (--kv-dtype): widening is exact.
                key, value = key.to(query.dtype), value.to(query.dtype)
            function = inner or _module_eager(module)
            return function(module, query, key, value, attention_mask, **kwargs)

        attention.exact_kernel_first = inner is not None  # read by takes_exact_kernel
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    for config in configs:
        config._attn_implementation = name


def _module_eager(module: Any) -> Any:
    """The eager attention function of the module's own modeling file (Gemma's differs)."""
    import sys

    found = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if found is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward

        found = eager_attention_forward
    return found
