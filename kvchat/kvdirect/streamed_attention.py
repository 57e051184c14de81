"""Attention over K/V too large to hold at once: the cold part arrives chunk by chunk.

Under a ceiling smaller than one layer's K/V for the whole context (e.g. 2 MB for 8K
SmolLM2 tokens: 12 MB of fp32 K/V per layer), the cache cannot hand attention the full K/V.
It hands over the hot part and leaves the cold range pending; this attention function then
recomputes the cold K/V a bounded chunk at a time (reading checkpoints from disk as needed)
and combines the chunks with the running-max softmax of FlashAttention (Dao et al. 2022,
arXiv 2205.14135; Milakov & Gimelshein 2018, arXiv 1805.02867). On CPU each chunk is one
call of torch's fused flash-attention kernel, which returns the chunk's log-sum-exp beside
its output, and chunks are merged by those; the spelled-out update (a dozen small ops per
chunk, each of which may wake the thread pool) is kept for other devices.

The attention sum is taken in another order than SDPA's kernel, and a forward call longer
than the chunk (a prefill chunk saved under a roomier ceiling) is projected in pieces, so
logits differ from the standard cache in the last bits (~2e-6 in fp32). The promise on this
path is therefore the same greedy tokens, not ``torch.equal`` logits; tests measure both.
Layers with nothing pending, and every layer when streaming is off, go through the model's
own attention function unchanged.

Hooked in through transformers' ``AttentionInterface``: the model's attention
implementation is renamed ``kvdirect_<original>`` while the cache is attached, with the
original mask function registered under the same name, and restored on ``remove()``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from kvchat.kvdirect.arch import ArchAdapter


# What this module reads of the cache (kvchat.kvdirect.cache, which imports this module):
# described here rather than imported, so the two do not depend on each other.
class ScratchCounter(Protocol):
    def note_scratch(self, n: int) -> None: ...


class StreamingCache(Protocol):
    stream_chunk: int | None
    decode_stream_chunk: int | None

    @property
    def stats(self) -> ScratchCounter: ...


class StreamedLayer(Protocol):
    """A cache layer that leaves cold positions ``pending_cold`` for attention to fetch."""

    layer_idx: int
    pending_cold: tuple[int, int] | None

    @property
    def owner(self) -> StreamingCache: ...

    def iter_cold_kv(
        self, begin: int, end: int, chunk_rows: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...


def _online_update(
    state: list[torch.Tensor | None],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> None:
    """Fold one block of keys/values into the running (max, sum, weighted values)."""
    scores = torch.matmul(query, key.transpose(-1, -2).float()) * scaling
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    running_max, running_sum, acc = state
    block_max = scores.amax(dim=-1, keepdim=True)
    new_max = block_max if running_max is None else torch.maximum(running_max, block_max)
    safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
    weights = torch.exp(scores - safe_max)
    block_sum = weights.sum(dim=-1, keepdim=True)
    block_acc = torch.matmul(weights, value.float())
    if running_max is None:
        state[:] = [new_max, block_sum, block_acc]
        return
    scale = torch.exp(running_max - safe_max)
    state[:] = [new_max, running_sum * scale + block_sum, acc * scale + block_acc]


def _fused_block(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention output, log-sum-exp) of one block by torch's fused CPU kernel: one call
    per block instead of a dozen small ones, each of which may wake the thread pool."""
    additive = visible = None
    if mask is not None:
        if mask.dtype == torch.bool:
            visible = mask.any(dim=-1)
            additive = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
            additive.masked_fill_(~mask, float("-inf"))
        else:
            additive = mask.float()
            visible = (additive > float("-inf")).any(dim=-1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key.float(), value.float(), 0.0, False, attn_mask=additive, scale=scaling
    )
    if visible is not None:
        # The kernel reports a block with no visible column as lse 0; it weighs nothing.
        lse = lse.masked_fill(~visible.expand_as(lse), float("-inf"))
    return out, lse


def _fold_block(state: list[torch.Tensor | None], out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge one block's normalized output into the running (output, log-sum-exp)."""
    if state[0] is None:
        state[:] = [out, lse]
        return
    acc, acc_lse = state
    total = torch.logaddexp(acc_lse, lse)
    safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    state[:] = [
        acc * torch.exp(acc_lse - safe).unsqueeze(-1) + out * torch.exp(lse - safe).unsqueeze(-1),
        total,
    ]


def streamed_attention(
    layer: StreamedLayer,
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of ``query`` over [pending cold K/V, ``key``/``value``]; [b, q, H, d].

    Grouped-query heads are folded into the query rows ([b, kv heads, groups * q, d]), so
    K/V are never widened to every query head (``repeat_kv``'s head order: query head
    ``h`` reads kv head ``h // groups``). On CPU each block goes through torch's fused
    attention kernel and blocks are merged by their log-sum-exp; elsewhere the running-max
    update is spelled out.
    """
    begin, end = layer.pending_cold
    layer.pending_cold = None
    batch, heads, q_len, dim = query.shape
    groups = getattr(module, "num_key_value_groups", 1)
    scaling = scaling if scaling is not None else 1.0 / math.sqrt(dim)
    folded = query.float().reshape(batch, heads // groups, groups * q_len, dim)
    fused = query.device.type == "cpu"

    def rows_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
        return mask if mask is None or groups == 1 else mask.repeat(1, 1, groups, 1)

    state: list[torch.Tensor | None] = [None, None] if fused else [None, None, None]

    def fold(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
        if fused:
            _fold_block(state, *_fused_block(folded, k, v, rows_mask(mask), scaling))
        else:
            _online_update(state, folded, k, v, rows_mask(mask), scaling)

    column = 0
    stats = layer.owner.stats
    owner = layer.owner
    chunk = owner.decode_stream_chunk if q_len == 1 and owner.decode_stream_chunk else None
    for cold_k, cold_v in layer.iter_cold_kv(begin, end, chunk or owner.stream_chunk):
        n = cold_k.shape[-2]
        if n == 0:
            continue
        mask = None if attention_mask is None else attention_mask[..., column : column + n]
        stats.note_scratch(2 * cold_k.numel() * cold_k.element_size() + heads * q_len * n * 8)
        fold(cold_k, cold_v, mask)
        column += n
    if column != end - begin:
        raise RuntimeError(f"layer {layer.layer_idx}: streamed {column} of {end - begin} rows")
    n_hot = key.shape[-2]
    if attention_mask is not None:
        mask = attention_mask[..., column : column + n_hot]
    elif q_len > 1:
        # No mask means plain causal over what is handed here (the new rows come last).
        rows = torch.arange(q_len, device=query.device).unsqueeze(1) + (n_hot - q_len)
        mask = (torch.arange(n_hot, device=query.device).unsqueeze(0) <= rows)[None, None]
    else:
        mask = None
    fold(key, value, mask)
    if fused:
        out = state[0]
    else:
        _, total, acc = state
        out = acc / total
    out = out.reshape(batch, heads, q_len, -1).to(query.dtype)
    return out.transpose(1, 2).contiguous()


PREFIX = "kvdirect_"


class StreamedAttention:
    """Routes a model's attention through ``streamed_attention`` while a cache needs it.

    Several sessions may share one model (tests, the app's resume): the patch is installed
    once per model and counted; each layer binds itself to its attention module when it
    leaves a cold range pending, so the cache running the current forward call is the one
    read. The model's own attention implementation is restored when the last user goes.
    """

    def __init__(self, adapter: ArchAdapter) -> None:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

        self.modules = [adapter.attention_module(i) for i in range(adapter.num_layers)]
        self.configs = []
        for module in self.modules:
            if all(module.config is not c for c in self.configs):
                self.configs.append(module.config)
        first = self.modules[0]
        users = getattr(first, "_kvdirect_users", 0)
        first._kvdirect_users = users + 1
        if users:
            return  # already patched by another cache on this model
        self.original = self.configs[0]._attn_implementation or "eager"
        first._kvdirect_original = self.original
        name = PREFIX + self.original
        if self.original == "eager":
            from transformers.models.llama.modeling_llama import eager_attention_forward

            inner = eager_attention_forward
        else:
            inner = ALL_ATTENTION_FUNCTIONS[self.original]
        original = self.original

        def attention(module: Any, query, key, value, attention_mask, **kwargs):
            layer = getattr(module, "_kvdirect_layer", None)
            if layer is None or layer.pending_cold is None:
                if original == "eager":
                    eager = getattr(module, "_kvdirect_eager", None) or inner
                    return eager(module, query, key, value, attention_mask, **kwargs)
                return inner(module, query, key, value, attention_mask, **kwargs)
            scaling = kwargs.get("scaling")
            return streamed_attention(
                layer, module, query, key, value, attention_mask, scaling
            ), None

        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[self.original])
        for module in self.modules:
            module._kvdirect_eager = _module_eager(module)
        for config in self.configs:
            config._attn_implementation = name

    def remove(self) -> None:
        first = self.modules[0]
        first._kvdirect_users = getattr(first, "_kvdirect_users", 1) - 1
        if first._kvdirect_users > 0:
            return
        original = getattr(first, "_kvdirect_original", "sdpa")
        for config in self.configs:
            config._attn_implementation = original
        for module in self.modules:
            for attr in ("_kvdirect_layer", "_kvdirect_eager", "_kvdirect_users"):
                if hasattr(module, attr):
                    delattr(module, attr)
        if hasattr(first, "_kvdirect_original"):
            del first._kvdirect_original


def _module_eager(module: Any) -> Any:
    """The eager attention function of the module's own modeling file (Gemma's differs)."""
    import sys

    return getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
