"""What to hold where under ``--max-mem``: the cold form per layer, the hot windows, the tier.

The planner works from the per-layer bytes of ``footprint.py``. Conversation state is

    sum over residual-form layers of  tokens_kept * residual + min(B, tokens) * kv
  + sum over K/V-form layers of       min(W + R, tokens) * kv
  + scratch (one layer's K/V for the tokens it attends to, plus the copy handed to
    attention) whenever anything cold is read back
  + token ids (8 bytes each)

where sliding-window layers keep at most about one window of tokens, and R is the rows a
K/V-form window holds ahead for decode steps under the disk tier when attention gets whole
K/V (``KV_STEP_RESERVE`` plus the step's row; 0 otherwise). In order:

1. everything fits: nothing is evicted (K/V-form layers then hold what DynamicCache holds),
   and where the ceiling also holds ``GROWTH_RESERVE_ROWS`` more rows per layer, the hot
   windows grow into that reserve (``Plan.hot_reserve``, counted) as with no ceiling;
2. residual checkpoints fit but not every K/V: the residual layers' hot window B shrinks;
3. the disk tier: K/V-form layers keep their last W tokens resident and the rest as K/V on
   disk; residual layers keep B hot and a budget of checkpoints resident, the rest on disk.
   If one layer's whole K/V for the context (the scratch handed to attention) does not fit
   either, attention is streamed over chunks (``Plan.stream_chunk``, streamed_attention.py).

No plan changes a bit of the output. The rows per forward call (``--prefill-chunk``) are
never changed by a ceiling, since the model's matmuls give a row bits that depend on how
many rows share the call; attention sums in one order whatever the chunks
(exact_attention.py); a checkpointed call is replayed whole, with its own row count. The
attention call's own state (a running max, sum and output per query row) is sized like the
query and the output, activations of the forward call, and is not counted as conversation
state; what streaming bounds is the cold K/V it reads.

Only when token ids and the smallest chunk's scratch alone pass half the ceiling is a
prompt refused, with the smallest ceiling that would run it.

Plans are memoised per block of ``PLAN_BLOCK`` tokens: a plan made for the end of a block
fits every length before it (every term above grows with the token count), so decoding
plans again once per block, not once per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvchat.engine.kvdirect.footprint import LayerFootprint, ModelFootprint
from kvchat.errors import NeedsDiskTierError
from kvchat.units import human_bytes

if TYPE_CHECKING:
    from kvchat.engine.kvdirect.costs import DeviceCosts

TOKEN_ID_BYTES = 8


def choose_forms(
    fp: ModelFootprint, checkpoint: str, costs: DeviceCosts | None = None
) -> list[str]:
    """Cold form per layer: the paper's residual, plain K/V, or ``auto``: the cheaper exact
    form per step under the measured ``costs`` (see costs.py), else the smaller one."""
    if checkpoint == "auto":
        if costs is not None:
            return [costs.cheaper_form(layer) for layer in fp.layers]
        return [layer.smaller_exact_form for layer in fp.layers]
    if checkpoint in ("residual", "kv"):
        return [checkpoint] * fp.num_layers
    raise ValueError(f"unknown checkpoint form {checkpoint!r} (residual, kv or auto)")


@dataclass(frozen=True)
class StateEstimate:
    hot_kv: int
    checkpoints: int
    scratch: int
    token_ids: int

    @property
    def total(self) -> int:
        return self.hot_kv + self.checkpoints + self.scratch + self.token_ids


@dataclass(frozen=True)
class Plan:
    """What the cache does for the next forward call."""

    hot_window: int | None = None  # residual layers; None: keep every token's K/V hot
    checkpoint_budget: int | None = None  # resident checkpoint bytes; None: all in memory
    stream_chunk: int | None = None  # rows per streamed attention chunk; None: whole K/V
    kv_window: int | None = None  # K/V-form layers under the disk tier; None: all hot
    decode_stream_chunk: int | None = None  # rows per streamed chunk for one-token steps
    kv_reserve: int = 0  # rows a K/V-form hot window may hold beyond kv_window (counted)
    hot_reserve: int = 0  # rows each growing hot window may hold ahead, all in memory (counted)
    estimate: StateEstimate | None = field(default=None, compare=False)

    @property
    def disk_tier(self) -> bool:
        return self.checkpoint_budget is not None

    def describe(self) -> str:
        """One phrase for the memory line, --json and the gauge."""
        if not self.disk_tier:
            return "all in memory" if self.hot_window is None else f"hot window {self.hot_window}"
        parts = ["disk tier"]
        if self.kv_window is not None:
            parts.append(f"K/V: last {self.kv_window} resident")
        if self.hot_window is not None:
            parts.append(f"residual: {self.hot_window} hot")
        if self.stream_chunk is not None:
            parts.append(f"streamed attention ({self.stream_chunk} rows)")
        return ", ".join(parts)


READ_CHUNK_ROWS = 256  # rows read from disk at once on the bit-identical path
STREAM_CHUNKS = (1024, 512, 256, 128, 64, 32, 16)
DECODE_STREAM_CHUNKS = (4096, 2048, 1024, 512, 256, 128, 64, 32, 16)
PLAN_BLOCK = 32
DECODE_HOT_ROWS = 4  # K/V rows a decode step keeps resident at least, before its chunk grows
# Rows a K/V-form hot window holds ahead under the disk tier when attention gets whole K/V:
# a decode step appends its row there and attention reads the window where it lies, instead
# of the window being copied next to the cold rows and back out at every layer and step.
KV_STEP_RESERVE = 16
# Rows each hot window holds ahead while every token is kept (no ceiling, or one that holds
# them all and these rows too): a decode step copies one row there instead of concatenating
# the whole window into a fresh tensor, at every layer.
GROWTH_RESERVE_ROWS = 64


class Planner:
    """Derives the hot windows and the tier from the ceiling for a given number of tokens."""

    def __init__(
        self,
        fp: ModelFootprint,
        forms: list[str],
        ceiling: int | None,
        prefill_chunk: int,
    ) -> None:
        self.fp = fp
        self.forms = forms
        self.ceiling = ceiling
        self.prefill_chunk = prefill_chunk
        self._memo: tuple[int, Plan] | None = None
        self.residual = [(x, f) for x, f in zip(fp.layers, forms) if f == "residual"]
        self.kv = [x for x, f in zip(fp.layers, forms) if f == "kv"]

    def estimate(
        self,
        n_tokens: int,
        hot_window: int | None,
        kv_window: int | None = None,
        reserve: int = 0,
    ) -> StateEstimate:
        """``reserve``: rows each window that keeps every visible token holds ahead."""
        hot = ckpt = scratch = 0
        for layer in self.kv:
            visible = _visible(layer, n_tokens)
            w = visible if kv_window is None else min(kv_window, visible)
            hot += (w + (reserve if w == visible else 0)) * layer.kv_bytes
            if w < visible:
                scratch = max(scratch, 2 * visible * layer.kv_bytes)
        for layer, _ in self.residual:
            visible = _visible(layer, n_tokens)
            kept = visible if not layer.is_sliding else min(n_tokens, visible + self.prefill_chunk)
            b = visible if hot_window is None else min(hot_window, visible)
            ckpt += kept * layer.residual_bytes
            hot += (b + (reserve if b == visible else 0)) * layer.kv_bytes
            if b < visible:
                # recomputed cold K/V + the full K/V handed to attention
                scratch = max(scratch, 2 * visible * layer.kv_bytes)
        return StateEstimate(hot, ckpt, scratch, n_tokens * TOKEN_ID_BYTES)

    def hot_window_for(self, n_tokens: int) -> int | None:
        """Largest B that fits under the ceiling at ``n_tokens`` (None: keep everything)."""
        return self.plan(n_tokens).hot_window

    def plan(self, n_tokens: int) -> Plan:
        """The plan for the next call, memoised per block of tokens (see module docstring)."""
        if self.ceiling is None:
            return self.plan_exact(n_tokens)
        if self._memo is not None and self._memo[0] - PLAN_BLOCK < n_tokens <= self._memo[0]:
            return self._memo[1]
        block_end = -(-n_tokens // PLAN_BLOCK) * PLAN_BLOCK
        try:
            plan = self.plan_exact(block_end)
        except NeedsDiskTierError:
            return self.plan_exact(n_tokens)  # the block's end would not fit; this length may
        self._memo = (block_end, plan)
        return plan

    def plan_exact(self, n_tokens: int) -> Plan:
        """Hot windows, and the disk tier when the state does not fit in memory."""
        if self.ceiling is None:
            return Plan(hot_reserve=GROWTH_RESERVE_ROWS)
        everything = self.estimate(n_tokens, None)
        if everything.total <= self.ceiling:
            growing = self.estimate(n_tokens, None, reserve=GROWTH_RESERVE_ROWS)
            if growing.total <= self.ceiling:
                return Plan(hot_reserve=GROWTH_RESERVE_ROWS, estimate=growing)
            return Plan(estimate=everything)
        if self.residual:
            floor = self.estimate(n_tokens, 0)
            if floor.total <= self.ceiling:
                b = self._largest(n_tokens, lambda w: self.estimate(n_tokens, w).total)
                return Plan(hot_window=b, estimate=self.estimate(n_tokens, b))
        return self._disk_plan(n_tokens)

    def _largest(self, n_tokens: int, cost) -> int:
        lo, hi = 0, n_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost(mid) <= self.ceiling:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- disk tier -----------------------------------------------------------------------
    def _disk_plan(self, n_tokens: int) -> Plan:
        layers = [(x, _visible(x, n_tokens), f) for x, f in zip(self.fp.layers, self.forms)]
        fixed = n_tokens * TOKEN_ID_BYTES
        whole = max(
            2 * visible * x.kv_bytes + READ_CHUNK_ROWS * _row_bytes(x, form)
            for x, visible, form in layers
        )
        stream_chunk = None
        scratch = whole
        if fixed + scratch > self.ceiling // 2:
            for chunk in STREAM_CHUNKS:
                scratch = max(self._stream_scratch(x, chunk, form) for x, _, form in layers)
                if fixed + scratch <= self.ceiling // 2:
                    stream_chunk = chunk
                    break
            else:
                need = 2 * (fixed + scratch)
                # A residual checkpoint is replayed one whole forward call at a time.
                hint = (
                    f", or --checkpoint kv, or a smaller --prefill-chunk than {self.prefill_chunk}"
                    if "residual" in self.forms
                    else ""
                )
                raise NeedsDiskTierError(
                    f"--max-mem {human_bytes(self.ceiling)} is too small for {n_tokens} tokens "
                    f"even with the disk tier: it needs at least {human_bytes(need)} (token ids "
                    f"{human_bytes(fixed)} and the smallest read-back scratch "
                    f"{human_bytes(scratch)}, with as much again for the hot window); "
                    f"use --max-mem {_round_up(need)} or more{hint}"
                )
        decode_chunk = None
        if stream_chunk is not None:
            # A decode step pays per streamed chunk, and a resident K/V row saves it only
            # one row's read: the chunk takes what the ceiling leaves beyond a few hot rows.
            reserve = sum(min(DECODE_HOT_ROWS, v) * x.kv_bytes for x, v, _ in layers)
            budget = max(self.ceiling // 2, self.ceiling - reserve) - fixed
            decode_chunk = self._decode_chunk(layers, budget)
            decode_scratch = max(self._stream_scratch(x, decode_chunk, f) for x, _, f in layers)
            scratch = max(scratch, decode_scratch)  # a step is one or the other, never both
        room = self.ceiling - fixed - scratch
        res = [(x, v) for x, v, f in layers if f == "residual"]
        kvs = [(x, v) for x, v, f in layers if f == "kv"]
        need_kv = sum(v * x.kv_bytes for x, v in kvs)
        need_res = sum(v * (x.kv_bytes + x.residual_bytes) for x, v in res)
        room_kv = room * need_kv // max(1, need_kv + need_res)
        room_res = room - room_kv

        def hot(window: int, group: list, ahead: int = 0) -> int:
            return sum(min(window + ahead, v) * x.kv_bytes for x, v in group)

        # The window's storage: its rows, the one a step adds, and the reserve.
        kv_reserve = KV_STEP_RESERVE if stream_chunk is None else 0
        kv_ahead = kv_reserve + 1 if kv_reserve else 0
        kv_window = None
        if kvs:
            kv_window = self._largest(
                n_tokens, lambda w: hot(w, kvs, kv_ahead) + self.ceiling - room_kv
            )
        b, budget = None, 0
        if res:
            b = self._largest(n_tokens, lambda w: 2 * hot(w, res) + self.ceiling - room_res)
            budget = max(0, room_res - hot(b, res))
        used = (hot(kv_window, kvs, kv_ahead) if kvs else 0) + (hot(b, res) if res else 0)
        estimate = StateEstimate(used, budget, scratch, fixed)
        return Plan(b, budget, stream_chunk, kv_window, decode_chunk, kv_reserve, estimate=estimate)

    def _stream_scratch(self, layer: LayerFootprint, rows: int, form: str = "residual") -> int:
        """Peak bytes of one streamed chunk of ``rows`` cold tokens: K/V rows are read into
        one window buffer and viewed in place there; a residual checkpoint is replayed a
        whole forward call at a time (its row count keeps the bits), so up to one prefill
        chunk of rows is read, normed and projected to K/V, whatever ``rows`` is."""
        if form == "residual":
            replayed = max(rows, self.prefill_chunk)
            return replayed * (2 * layer.residual_bytes + layer.kv_bytes)
        return rows * layer.kv_bytes

    def _decode_chunk(self, layers: list, budget: int) -> int:
        """The largest streamed chunk a one-token step can use within ``budget`` bytes of
        scratch: a decode step has one query row, not a prefill chunk's ``rows``."""
        for rows in DECODE_STREAM_CHUNKS:
            need = max(self._stream_scratch(x, rows, f) for x, _, f in layers)
            if need <= budget:
                return rows
        return DECODE_STREAM_CHUNKS[-1]


def _row_bytes(layer: LayerFootprint, form: str) -> int:
    return layer.residual_bytes if form == "residual" else layer.kv_bytes


def _round_up(n: int) -> str:
    """A ceiling a user can type: ``n`` bytes rounded up to two significant figures."""
    import math

    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if n >= size or unit == "B":
            value = n / size
            step = 10 ** (math.floor(math.log10(value)) - 1) if value >= 1 else 0.1
            return f"{math.ceil(value / step - 1e-9) * step:.10g}{unit}"
    return f"{n}B"


def _visible(layer: LayerFootprint, n_tokens: int) -> int:
    if layer.is_sliding and layer.sliding_window is not None:
        return min(n_tokens, layer.sliding_window)
    return n_tokens
