"""Attention over K/V too large to hold at once: the cold part arrives chunk by chunk.

Under a ceiling smaller than one layer's K/V for the whole context (e.g. 2 MB for 8K
SmolLM2 tokens: 12 MB of fp32 K/V per layer), the cache cannot hand attention the full K/V.
It hands over the hot part and leaves the cold range pending (``attention.pending_stream``);
this function then fetches the cold K/V a bounded chunk at a time (recomputed from
checkpoints or read from disk) and folds each chunk into the running state of kvchat's
exact attention (``exact_attention.AttentionState``), then the hot rows. That kernel folds
keys one at a time in position order, so the chunks' boundaries change no bit: the output
is ``torch.equal`` to the same call over the whole K/V, which is what the standard cache
and the unbounded cache run too.

Where the exact kernel cannot run (another device, no C compiler), chunks go through
torch's attention and are merged by their log-sum-exp (FlashAttention's running-max
softmax: Dao et al. 2022, arXiv 2205.14135; Milakov & Gimelshein 2018, arXiv 1805.02867).
That sums in another order than whole-K/V attention, so there the promise is the same
greedy tokens, not the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch


# What this module reads of the cache (kvchat.engine.kvdirect.cache, which imports this module):
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

    def cold_chunks(
        self, begin: int, end: int, chunk_rows: int | None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def finish_streamed(self) -> None: ...


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
    scaling: float,
    window: int | None,
    exact: bool | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over [pending cold K/V, ``key``/``value``]; [b, q, H, d].
    ``window``: the layer's sliding window (None: full attention); ``exact``: whether the
    exact kernel serves, when the caller has checked already."""
    from kvchat.engine.kvdirect import exact_attention

    begin, end = layer.pending_cold
    layer.pending_cold = None
    q_len = query.shape[-2]
    total = end - begin + key.shape[-2]
    owner = layer.owner
    chunk = owner.decode_stream_chunk if q_len == 1 and owner.decode_stream_chunk else None
    cold = layer.cold_chunks(begin, end, chunk or owner.stream_chunk)
    if exact is None:
        exact = exact_attention.usable(module, query, attention_mask, total, window)
    if exact:
        state = exact_attention.AttentionState(query, scaling, total - q_len, window)
        column = 0
        for cold_k, cold_v in cold:
            n = cold_k.shape[-2]
            # The state is sized like the query (an activation); the cold rows are scratch.
            owner.stats.note_scratch(2 * cold_k.numel() * cold_k.element_size())
            state.fold(cold_k, cold_v, column)
            column += n
        _check_streamed(layer, column, end - begin)
        layer.finish_streamed()
        state.fold(key, value, column)
        return state.finish()
    out = _merged_by_lse(layer, module, query, key, value, attention_mask, scaling, cold)
    layer.finish_streamed()
    return out


def _check_streamed(layer: StreamedLayer, column: int, expected: int) -> None:
    if column != expected:
        raise RuntimeError(f"layer {layer.layer_idx}: streamed {column} of {expected} rows")


def _merged_by_lse(
    layer: StreamedLayer,
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    cold: Iterator[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The fallback off the exact kernel: each chunk by torch's attention, merged by
    log-sum-exp (see the module docstring for what it promises). Grouped-query heads are
    folded into the query rows ([b, kv heads, groups * q, d]), so K/V are never widened
    to every query head (``repeat_kv``'s head order)."""
    batch, heads, q_len, dim = query.shape
    groups = getattr(module, "num_key_value_groups", 1)
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
    for cold_k, cold_v in cold:
        n = cold_k.shape[-2]
        if n == 0:
            continue
        mask = None if attention_mask is None else attention_mask[..., column : column + n]
        stats.note_scratch(2 * cold_k.numel() * cold_k.element_size() + heads * q_len * n * 8)
        fold(cold_k, cold_v, mask)
        column += n
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
