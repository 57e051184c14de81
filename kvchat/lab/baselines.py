"""Eviction baselines: KV caches that keep a fixed budget of tokens and forget the rest.

These are what KV-Direct is compared against (``kvchat bench``, experiment ``eviction``). Each
policy is a transformers cache layer; ``EvictionCache`` holds one per attention layer and
hooks the model's attention modules. None of them is exact: a token they drop is gone, and
the model's output drifts from the unbounded cache's. KV-Direct (``kvdirect/cache.py``) recomputes
dropped K/V from residual checkpoints instead and stays exact.

Policies, each implemented from its paper (NVIDIA's kvpress would be preferred where faithful,
but kvpress 0.5.5 requires transformers < 5.3 and fails on the 5.24 this project uses):

* ``window``: the last ``B`` tokens (the plain sliding window every paper uses as a floor).
* ``streaming_llm``: Xiao et al. 2023, "Efficient Streaming Language Models with Attention
  Sinks", arXiv 2309.17453: 4 attention-sink tokens + the most recent ``B - 4``, with
  positions taken within the cache.
* ``h2o``: Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
  Large Language Models", arXiv 2306.14048: per head, ``B/2`` heavy hitters by accumulated
  attention + ``B/2`` recent tokens.
* ``snapkv``: Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before
  Generation", arXiv 2404.14469: at the end of each prefill, an observation window (the last
  32 prompt tokens) votes with its pooled attention, per head; the prompt is cut to ``B``
  and the decoded tokens are added after it.
* ``tova``: Oren et al. 2024, "Transformers are Multi-State RNNs", arXiv 2401.06104: whenever
  the cache is over ``B``, drop the tokens with the lowest attention from the current query,
  averaged over heads.

How the policies plug in
------------------------
* **Budget.** ``B`` tokens per layer (per KV head): after every forward call each layer holds
  at most ``B`` positions. Sliding-window layers (Gemma 3, Mistral) can only ever see the last
  ``window - 1`` tokens, so there each policy picks at most ``min(B, window - 1)`` among
  those (StreamingLLM's sinks are outside that window, so on sliding layers it keeps the most
  recent tokens). With ``B`` >= the context every policy is ``DynamicCache``, bit for bit.
* **Timing.** ``update`` appends the new K/V and returns everything held (attention always
  sees the held tokens plus the new ones, like every paper's implementation). Policies that
  need no scores (window, StreamingLLM) evict right there; the others evict in ``observe``,
  which a forward hook on the attention module calls with that step's attention weights,
  i.e. after the attention of the step and before the next one. Those need the model to run
  with ``attn_implementation="eager"`` (the only one that returns weights).
* **Chunked prefill.** Each forward call is a step: a 256-token chunk attends to the held
  tokens plus itself, then the layer evicts back to ``B``. SnapKV is the exception by design:
  it holds the whole prompt until ``EvictionCache.end_prefill()`` (which the caller must call
  after each prefill) and then compresses once.
* **Per-head selection.** H2O and SnapKV choose per KV head (scores of the query heads of a
  GQA group are summed, H2O, or averaged, SnapKV), so heads hold different positions. The
  cache keeps a position per slot (``positions``, -1 for an empty slot) and a pre-hook on the
  attention module replaces the model's mask with one built from those positions (causal and,
  on sliding layers, windowed by true position). With nothing evicted it is the model's own
  mask, value for value.
* **Positions.** Keys keep the RoPE of their original position, except StreamingLLM's sinks:
  the paper assigns positions within the cache ([0, 1, 2, 3, 6, 7, 8] is attended as
  [0 ... 6]); since RoPE depends only on relative distance and the recent tokens are
  contiguous, that is the same as rotating the 4 sink keys forward by the number of tokens
  evicted between them and the recent window, which ``update`` does (from the keys as first
  cached, so rotations never accumulate error).

Batch size 1 only (the engine's case). GPT-2 (learned absolute positions, no ``self_attn``) is
not supported.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from kvchat.engine.kvdirect.arch import ArchAdapter, UnsupportedArchitectureError

KEEP = 1e12  # rank offset of slots a policy always keeps (sinks, recent window, SnapKV window)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class EvictionLayer(CacheLayerMixin):
    """One attention layer under an eviction policy: at most ``capacity`` positions held."""

    is_compileable = False
    is_croppable = False
    needs_attention = False  # True: evicts in ``observe`` from the step's attention weights
    policy = ""
    _slot_state: tuple[str, ...] = ()  # per-slot tensors [kv_heads, L] gathered with the slots

    def __init__(
        self,
        owner: EvictionCache,
        layer_idx: int,
        budget: int,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        if budget < 1:
            raise ValueError("the budget must be at least one token")
        self.owner = owner
        self.layer_idx = layer_idx
        self.budget = budget
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.capacity = budget if sliding_window is None else min(budget, sliding_window - 1)
        self.cumulative_length = 0
        self.positions: torch.Tensor | None = None  # [kv_heads, L] long; -1 = empty slot
        self.evicted_tokens = 0  # slots dropped by the policy (not by the native window)

    # -- CacheLayerMixin -----------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[0] != 1:
            raise ValueError("eviction baselines support batch size 1 only")
        self.device = key_states.device
        heads = key_states.shape[1]
        self.keys = key_states.new_empty((1, heads, 0, key_states.shape[-1]))
        self.values = value_states.new_empty((1, heads, 0, value_states.shape[-1]))
        self.positions = torch.empty((heads, 0), dtype=torch.long, device=self.device)
        for name in self._slot_state:
            setattr(self, name, torch.empty((heads, 0), dtype=torch.float64, device=self.device))
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.cumulative_length  # positions of new tokens follow every token seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The model builds its mask from these; the pre-hook replaces it with the exact one.
        held = self.held
        return held + query_length, max(self.cumulative_length - held, 0)

    @property
    def held(self) -> int:
        """Slots held now (the K/V memory in use), empty ones included."""
        return 0 if self.keys is None else self.keys.shape[-2]

    def held_positions(self) -> list[list[int]]:
        """Per KV head, the positions held (empty slots left out)."""
        if self.positions is None:
            return []
        return [[p for p in row.tolist() if p >= 0] for row in self.positions]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.needs_attention and not self.owner.attached:
            raise RuntimeError(
                f"{self.policy} evicts by attention weights: attach the cache "
                "(EvictionCache.attach) and run the model with eager attention"
            )
        n = key_states.shape[-2]
        start = self.cumulative_length
        new_pos = torch.arange(start, start + n, device=self.device)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.positions = torch.cat([self.positions, new_pos.expand(self.positions.shape[0], n)], -1)
        for name in self._slot_state:
            state = getattr(self, name)
            setattr(self, name, torch.cat([state, state.new_zeros((state.shape[0], n))], -1))
        self.cumulative_length = start + n
        keys, values = self._keys_for_attention(), self.values
        if not self.needs_attention:
            self._evict(None)
        return keys, values

    # -- the hooks' side -----------------------------------------------------------------
    def attention_mask(
        self, n_new: int, num_heads: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Additive mask [1, heads or 1, n_new, held + n_new] for the coming call.

        Built from true positions: a query sees a held or new key if the key is not later
        than itself and, on sliding layers, within the window. With contiguous positions
        this equals the mask transformers builds (same 0 / dtype-min values).
        """
        start = self.cumulative_length
        q = torch.arange(start, start + n_new, device=device)
        held = (
            self.positions
            if self.positions is not None
            else torch.empty((1, 0), dtype=torch.long, device=device)
        )
        kv = torch.cat([held, q.expand(held.shape[0], n_new)], dim=-1)[:, None, :]
        allowed = (kv >= 0) & (kv <= q[None, :, None])
        if self.is_sliding:
            allowed &= kv > q[None, :, None] - self.sliding_window
        if allowed.shape[0] > 1:
            if bool((allowed == allowed[:1]).all()):
                allowed = allowed[:1]
            else:
                allowed = allowed.repeat_interleave(num_heads // allowed.shape[0], dim=0)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None]

    def observe(self, weights: torch.Tensor | None) -> None:
        """Attention weights [1, heads, n_new, held] of the call that just ran."""
        if weights is None:
            raise RuntimeError(
                f"{self.policy} needs attention weights; load or set the model with "
                "attn_implementation='eager'"
            )
        if weights.shape[-1] != self.held:
            raise RuntimeError(
                f"layer {self.layer_idx}: attention over {weights.shape[-1]} keys, cache holds "
                f"{self.held} (hooks out of step with the cache)"
            )
        self._evict(weights)

    def end_prefill(self) -> None:
        """The prompt is in: policies that decide once per prompt (SnapKV) decide now."""

    # -- policy --------------------------------------------------------------------------
    def _keys_for_attention(self) -> torch.Tensor:
        return self.keys

    def _rank(self, weights: torch.Tensor | None) -> torch.Tensor | None:
        """[kv_heads, L] float64, higher = keep; None: the policy evicts nothing now."""
        raise NotImplementedError

    def _visible(self) -> torch.Tensor:
        """Slots a later query can still attend to: not empty and, sliding, in the window."""
        visible = self.positions >= 0
        if self.is_sliding:
            visible &= self.positions > self.cumulative_length - self.sliding_window
        return visible

    def _evict(self, weights: torch.Tensor | None) -> None:
        rank = self._rank(weights)
        limit = self.capacity
        if rank is None:  # only what the native window hides goes
            rank, limit = self.positions.double(), self.held
        self._select(rank, limit)

    def _select(self, rank: torch.Tensor, limit: int) -> None:
        """Keep, per KV head, the ``limit`` visible slots of highest rank (in slot order)."""
        visible = self._visible()
        counts = visible.sum(dim=-1)
        k = min(limit, int(counts.max()) if counts.numel() else 0)
        if k == self.held and bool(visible.all()):
            return
        rank = rank.masked_fill(~visible, float("-inf"))
        top = rank.topk(k, dim=-1).indices.sort(dim=-1).values  # [kv_heads, k]
        kept_visible = visible.gather(-1, top)
        self.evicted_tokens += int(counts.sum() - kept_visible.sum())
        index = top[None, :, :, None]
        self.keys = self.keys.gather(2, index.expand(-1, -1, -1, self.keys.shape[-1]))
        self.values = self.values.gather(2, index.expand(-1, -1, -1, self.values.shape[-1]))
        self.positions = self.positions.gather(-1, top).masked_fill(~kept_visible, -1)
        for name in self._slot_state:
            setattr(self, name, getattr(self, name).gather(-1, top))

    # -- accounting / forking ------------------------------------------------------------
    def kv_bytes(self) -> int:
        return _nbytes(self.keys) + _nbytes(self.values)

    def _clone(self, owner: EvictionCache) -> EvictionLayer:
        twin = copy.copy(self)  # tensors are replaced, never written in place: sharing is safe
        twin.owner = owner
        return twin


class WindowLayer(EvictionLayer):
    """Window-only: the most recent ``B`` tokens."""

    policy = "window"

    def _rank(self, weights: torch.Tensor | None) -> torch.Tensor:
        return self.positions.double()


class StreamingLLMLayer(EvictionLayer):
    """StreamingLLM (Xiao et al. 2023, arXiv 2309.17453): attention sinks + recent window.

    Keeps the first ``n_sink`` (4) tokens and the most recent ``B - n_sink``. Positions are
    those within the cache (paper, Sec. 3.2): the sink keys are re-rotated forward by the
    number of tokens evicted after them, which gives every query-key pair its in-cache
    distance (the recent tokens are contiguous with the query, so only the sinks move).
    ``reposition=False`` keeps original positions (what kvpress's StreamingLLMPress does).
    On sliding-window layers the sinks lie outside what the layer may see: recent tokens only.
    """

    policy = "streaming_llm"

    def __init__(self, *args: Any, n_sink: int = 4, reposition: bool = True, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.n_sink = n_sink
        self.reposition = reposition

    def sink_shift(self) -> int:
        """How far the sink keys are rotated: tokens evicted between sinks and recent ones."""
        if self.is_sliding or self.positions is None or self.held <= self.n_sink:
            return 0
        return max(int(self.positions[0, self.n_sink]) - self.n_sink, 0)

    def _keys_for_attention(self) -> torch.Tensor:
        shift = self.sink_shift() if self.reposition else 0
        if shift == 0:
            return self.keys
        s = self.n_sink
        sinks = self.owner.rotate_keys(self.layer_idx, self.keys[..., :s, :], shift)
        return torch.cat([sinks, self.keys[..., s:, :]], dim=-2)

    def _rank(self, weights: torch.Tensor | None) -> torch.Tensor:
        rank = self.positions.double()
        if not self.is_sliding:
            rank = torch.where(self.positions < self.n_sink, rank + KEEP, rank)
        return rank


class H2OLayer(EvictionLayer):
    """H2O (Zhang et al. 2023, arXiv 2306.14048): heavy hitters + recent tokens, per head.

    Every held token accumulates the attention it receives from every query while held
    (the paper's accumulated attention score; summed over the query heads of a GQA group).
    After each step a head keeps its ``B // 2`` most recent tokens and the ``B - B // 2``
    others with the highest accumulated score.
    """

    policy = "h2o"
    needs_attention = True
    _slot_state = ("scores",)

    def _rank(self, weights: torch.Tensor) -> torch.Tensor:
        kv_heads = self.positions.shape[0]
        received = weights[0].double().sum(dim=1)  # [heads, L]: over the step's queries
        received = received.view(kv_heads, -1, received.shape[-1]).sum(dim=1)
        self.scores = self.scores + received
        recent = self.capacity // 2
        is_recent = self.positions >= self.cumulative_length - recent
        return torch.where(is_recent, self.positions.double() + KEEP, self.scores)


class TOVALayer(EvictionLayer):
    """TOVA (Oren et al. 2024, arXiv 2401.06104): drop the lowest-attention tokens.

    At each step, over the cache's ``B`` limit, the tokens the current query attends to least
    (weights averaged over all heads of the layer, so all heads keep the same tokens) are
    dropped; one per decoded token. For a prefill chunk the chunk's last query scores.
    """

    policy = "tova"
    needs_attention = True

    def _rank(self, weights: torch.Tensor) -> torch.Tensor:
        current = weights[0, :, -1, :].double().mean(dim=0)  # [L]
        return current.expand(self.positions.shape[0], -1)


class SnapKVLayer(EvictionLayer):
    """SnapKV (Li et al. 2024, arXiv 2404.14469): the prompt's end votes, once per prompt.

    While a prompt is prefilled everything is held. At ``end_prefill`` the attention of the
    last ``window`` (32) queries is summed per key, smoothed with a 1-D pooling (avgpool,
    kernel 5, as the authors' code) and averaged over the query heads of each GQA group; per
    KV head the ``B - window`` best prompt tokens plus the window are kept. Tokens decoded
    afterwards are all kept (so the cache grows past ``B`` while decoding, as in the paper);
    the next turn's prefill compresses again.
    """

    policy = "snapkv"
    needs_attention = True

    def __init__(
        self,
        *args: Any,
        window: int = 32,
        kernel_size: int = 5,
        pooling: str = "avgpool",
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        if pooling not in ("avgpool", "maxpool"):
            raise ValueError(f"unknown pooling {pooling!r}")
        self.window = window
        self.kernel_size = kernel_size
        self.pooling = pooling
        self._observed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, positions)

    def _rank(self, weights: torch.Tensor) -> None:
        rows = weights[0, :, -self.window :, :].float().clone()  # [heads, m, L], own storage
        self._observed.append((rows, self.positions))
        total = sum(r.shape[1] for r, _ in self._observed)
        while total - self._observed[0][0].shape[1] >= self.window:
            total -= self._observed.pop(0)[0].shape[1]
        return None

    def end_prefill(self) -> None:
        if self.positions is None or not self._observed:
            return
        rank = self._vote()
        self._observed = []
        self._select(rank, self.capacity)

    def _vote(self) -> torch.Tensor:
        kv_heads, slots = self.positions.shape
        heads = self._observed[0][0].shape[0]
        group = heads // kv_heads
        length = self.cumulative_length
        # Rows of earlier calls index earlier layouts: move every row into position space.
        votes = torch.zeros((heads, length), dtype=torch.float64, device=self.positions.device)
        n_rows = sum(r.shape[1] for r, _ in self._observed)
        skip = max(n_rows - self.window, 0)  # the oldest call may hold a few rows too many
        for rows, positions in self._observed:
            if skip:
                cut = min(skip, rows.shape[1])
                rows, skip = rows[:, cut:, :], skip - cut
            pos = positions.repeat_interleave(group, dim=0)  # [heads, L_call]
            votes.scatter_add_(1, pos.clamp(min=0), rows.double().sum(dim=1) * (pos >= 0))
        held = self.positions.repeat_interleave(group, dim=0)
        in_window = held >= length - self.window
        score = votes.gather(1, held.clamp(min=0)) * (held >= 0) * ~in_window
        pool = F.avg_pool1d if self.pooling == "avgpool" else F.max_pool1d
        pad = self.kernel_size // 2
        score = pool(score[:, None, :], self.kernel_size, stride=1, padding=pad)[:, 0, :slots]
        score = score.view(kv_heads, group, slots).mean(dim=1)
        window_rank = self.positions.double() + KEEP
        return torch.where(self.positions >= length - self.window, window_rank, score)

    def _clone(self, owner: EvictionCache) -> EvictionLayer:
        twin = super()._clone(owner)
        twin._observed = list(self._observed)
        return twin


POLICY_LAYERS: dict[str, type[EvictionLayer]] = {
    "window": WindowLayer,
    "streaming_llm": StreamingLLMLayer,
    "h2o": H2OLayer,
    "snapkv": SnapKVLayer,
    "tova": TOVALayer,
}
POLICIES = tuple(POLICY_LAYERS)


class EvictionCache(Cache):
    """A transformers ``Cache`` whose layers follow one eviction policy at one budget.

    Use as ``with EvictionCache(model, "h2o", budget=64) as cache: model(..., cache=cache)``
    (the context manager attaches the attention hooks), with the model in eager attention
    for the policies that read attention weights, and call ``end_prefill()`` after each
    prefill (SnapKV compresses then; a no-op for the others).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        policy: str,
        budget: int,
        *,
        adapter: ArchAdapter | None = None,
        **options: Any,
    ) -> None:
        if policy not in POLICY_LAYERS:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        adapter = adapter if adapter is not None else ArchAdapter(model)
        if adapter.is_gpt2:
            raise UnsupportedArchitectureError(
                "eviction baselines need a RoPE model with self_attn modules (not GPT-2)"
            )
        self.adapter = adapter
        self.policy = policy
        self.budget = budget
        self.num_heads = adapter.config.num_attention_heads
        self.attached = False
        layer_cls = POLICY_LAYERS[policy]
        layers = [
            layer_cls(self, spec.index, budget, spec.sliding_window, **options)
            for spec in adapter.layers
        ]
        super().__init__(layers=layers)
        self._hooks: list[Any] = []

    # -- hooks ---------------------------------------------------------------------------
    def attach(self) -> EvictionCache:
        if self.attached:
            return self
        for layer, module in zip(self.layers, self.adapter.decoder_layers):
            attention = module.self_attn
            self._hooks.append(
                attention.register_forward_pre_hook(_mask_hook(self, layer), with_kwargs=True)
            )
            if layer.needs_attention:
                self._hooks.append(attention.register_forward_hook(_weights_hook(layer)))
        self.attached = True
        return self

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.attached = False

    def __enter__(self) -> EvictionCache:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- policy --------------------------------------------------------------------------
    def end_prefill(self) -> None:
        for layer in self.layers:
            layer.end_prefill()

    def rotate_keys(self, layer_idx: int, keys: torch.Tensor, shift: int) -> torch.Tensor:
        """``keys`` ([1, kv_heads, n, head_dim], already RoPE'd) moved ``shift`` positions on."""
        adapter = self.adapter
        position = torch.tensor([[shift]], device=keys.device)
        cos, sin = adapter.rope(layer_idx, keys, position)
        rotary = adapter.rotary
        layer_type = adapter.layers[layer_idx].layer_type
        scale = getattr(rotary, f"{layer_type}_attention_scaling", None)
        if scale is None:
            scale = getattr(rotary, "attention_scaling", 1.0)
        if scale != 1.0:  # cos/sin come scaled for queries/keys; a pure rotation is wanted
            cos, sin = cos / scale, sin / scale
        _, rotated = adapter.apply_rope(keys, keys, cos, sin)
        return rotated

    def fork(self) -> EvictionCache:
        """An independent copy of the state (detached), to branch a run at a given step."""
        twin = copy.copy(self)
        twin._hooks = []
        twin.attached = False
        twin.layers = [layer._clone(twin) for layer in self.layers]
        return twin

    # -- accounting ----------------------------------------------------------------------
    def kv_bytes(self) -> int:
        return sum(layer.kv_bytes() for layer in self.layers)

    def held_tokens(self) -> list[int]:
        return [layer.held for layer in self.layers]


def _mask_hook(cache: EvictionCache, layer: EvictionLayer):
    def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        # Every supported family's decoder layer passes attention_mask by keyword.
        kwargs["attention_mask"] = layer.attention_mask(
            hidden.shape[1], cache.num_heads, hidden.dtype, hidden.device
        )
        return args, kwargs

    return hook


def _weights_hook(layer: EvictionLayer):
    def hook(module: Any, args: tuple, output: Any) -> None:
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        layer.observe(weights)

    return hook
