"""What to hold where under ``--max-mem``: the cold form per layer and the hot window B.

The planner works from the per-layer bytes of ``footprint.py`` and re-plans before every
forward call, because B must shrink as the conversation grows: conversation state is

    sum over residual-form layers of  tokens_kept * residual + min(B, tokens) * kv
  + sum over kv-form layers of        tokens_kept * kv
  + recompute scratch (one layer's K/V for the tokens it attends to, plus the copy handed
    to attention) whenever anything is recomputed
  + token ids (8 bytes each)

where sliding-window layers keep at most about one window of tokens. The largest B whose
state fits is chosen.

If even B = 0 does not fit, the checkpoints themselves are over the ceiling and the plan
moves to the disk tier (``Plan.checkpoint_budget``): residual checkpoints beyond a resident
budget live in files and are read back in bounded chunks. If one layer's whole K/V for the
context (the scratch handed to attention) does not fit either, attention is streamed over
chunks of recomputed K/V (``Plan.stream_chunk``, see streamed_attention.py), which keeps the
greedy tokens but not bit-identical logits. Only when token ids, K/V-form layers and the
smallest chunk's scratch alone pass half the ceiling does the engine raise
``NeedsDiskTierError`` (the name predates the disk tier: "even the disk tier cannot help").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvchat.engine.footprint import LayerFootprint, ModelFootprint
from kvchat.errors import NeedsDiskTierError

TOKEN_ID_BYTES = 8


def parse_size(text: str | int | None) -> int | None:
    """``"64MB"``, ``"512KiB"``, ``"1.5GB"``, ``4096`` -> bytes (MB = 10^6, MiB = 2^20)."""
    if text is None or isinstance(text, int):
        return text
    s = text.strip().replace(" ", "")
    units = {
        "": 1, "B": 1,
        "K": 1000, "KB": 1000, "KIB": 1024,
        "M": 10**6, "MB": 10**6, "MIB": 2**20,
        "G": 10**9, "GB": 10**9, "GIB": 2**30,
        "T": 10**12, "TB": 10**12, "TIB": 2**40,
    }  # fmt: skip
    i = len(s)
    while i > 0 and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    number, unit = s[:i], s[i:].upper()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value < 0:
        raise ValueError(f"cannot read size {text!r}; write it like 64MB, 512KiB or 1.5GB")
    return int(value * units[unit])


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units up to PiB, then whole PiB in thousands."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    for unit in units:
        if abs(n) < 1024 or unit == units[-1]:
            break
        n /= 1024
    if unit == "B":
        return f"{n:.0f} B"
    return f"{n:,.0f} {unit}" if abs(n) >= 10_000 else f"{n:.1f} {unit}"


def choose_forms(fp: ModelFootprint, checkpoint: str) -> list[str]:
    """Cold form per layer: the paper's residual, plain K/V, or the smaller exact one."""
    if checkpoint == "auto":
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

    hot_window: int | None = None  # None: keep every token's K/V hot
    checkpoint_budget: int | None = None  # resident checkpoint bytes; None: all in memory
    stream_chunk: int | None = None  # rows per streamed attention chunk; None: whole K/V
    prefill_chunk: int | None = None  # cap on rows per forward call (streamed scratch)
    estimate: StateEstimate | None = field(default=None, compare=False)

    @property
    def disk_tier(self) -> bool:
        return self.checkpoint_budget is not None


READ_CHUNK_ROWS = 256  # residual rows read from disk at once on the bit-identical path
STREAM_CHUNKS = (1024, 512, 256, 128, 64, 32, 16)


class Planner:
    """Derives the hot window from the ceiling for a given number of tokens."""

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

    def estimate(self, n_tokens: int, hot_window: int | None) -> StateEstimate:
        hot = ckpt = scratch = 0
        for layer, form in zip(self.fp.layers, self.forms):
            visible = _visible(layer, n_tokens)
            if form == "kv":
                ckpt += visible * layer.kv_bytes
                continue
            kept = visible if not layer.is_sliding else min(n_tokens, visible + self.prefill_chunk)
            b = visible if hot_window is None else min(hot_window, visible)
            ckpt += kept * layer.residual_bytes
            hot += b * layer.kv_bytes
            if b < visible:
                # recomputed cold K/V + the full K/V handed to attention
                scratch = max(scratch, 2 * visible * layer.kv_bytes)
        return StateEstimate(hot, ckpt, scratch, n_tokens * TOKEN_ID_BYTES)

    def hot_window_for(self, n_tokens: int) -> int | None:
        """Largest B that fits under the ceiling at ``n_tokens`` (None: keep everything)."""
        return self.plan(n_tokens).hot_window

    def plan(self, n_tokens: int) -> Plan:
        """Hot window, and the disk tier when checkpoints alone pass the ceiling."""
        if self.ceiling is None:
            return Plan()
        if self.estimate(n_tokens, None).total <= self.ceiling:
            return Plan(estimate=self.estimate(n_tokens, None))
        floor = self.estimate(n_tokens, 0)
        if floor.total <= self.ceiling:
            b = self._largest(n_tokens, lambda w: self.estimate(n_tokens, w).total)
            return Plan(hot_window=b, estimate=self.estimate(n_tokens, b))
        return self._disk_plan(n_tokens, floor)

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
    def _disk_plan(self, n_tokens: int, floor: StateEstimate) -> Plan:
        residual = [
            (layer, _visible(layer, n_tokens))
            for layer, form in zip(self.fp.layers, self.forms)
            if form == "residual"
        ]
        kv_state = sum(
            _visible(layer, n_tokens) * layer.kv_bytes
            for layer, form in zip(self.fp.layers, self.forms)
            if form == "kv"
        )
        fixed = n_tokens * TOKEN_ID_BYTES + kv_state
        if not residual:
            raise NeedsDiskTierError(
                f"{n_tokens} tokens need {human_bytes(floor.total)} of K/V, over --max-mem "
                f"{human_bytes(self.ceiling)}; the disk tier holds residual checkpoints: use "
                "--checkpoint residual, or raise --max-mem"
            )
        whole = max(
            2 * visible * layer.kv_bytes + READ_CHUNK_ROWS * layer.residual_bytes
            for layer, visible in residual
        )
        stream_chunk = prefill_cap = None
        scratch = whole
        if fixed + scratch > self.ceiling // 2:
            for chunk in STREAM_CHUNKS:
                rows = min(chunk, self.prefill_chunk)
                scratch = max(self._stream_scratch(layer, rows) for layer, _ in residual)
                if fixed + scratch <= self.ceiling // 2:
                    stream_chunk, prefill_cap = rows, rows
                    break
            else:
                raise NeedsDiskTierError(
                    f"--max-mem {human_bytes(self.ceiling)} is too small for {n_tokens} tokens "
                    f"even with checkpoints on disk (token ids and K/V-form layers "
                    f"{human_bytes(fixed)}, smallest recompute scratch {human_bytes(scratch)}); "
                    "raise --max-mem"
                )
        room = self.ceiling - fixed - scratch

        def hot(window: int) -> int:
            return sum(min(window, visible) * layer.kv_bytes for layer, visible in residual)

        b = self._largest(n_tokens, lambda w: hot(w) * 2)  # half the room for the hot window
        b = min(b, max(0, room // 2 // max(1, sum(x.kv_bytes for x, _ in residual))))
        budget = max(0, room - hot(b))
        estimate = StateEstimate(hot(b), budget, scratch, n_tokens * TOKEN_ID_BYTES)
        return Plan(b, budget, stream_chunk, prefill_cap, estimate)

    def _stream_scratch(self, layer: LayerFootprint, rows: int) -> int:
        """Peak bytes of one streamed chunk of ``rows`` cold tokens for a prefill of ``rows``
        queries: residual rows read and normed, their K/V (and fp32 copies), the scores,
        weights and their difference from the running max (fp32, 4 bytes each, x3), plus
        the same for the hot block (the window plus the new rows) handed over beside it."""
        heads = layer.query_heads or max(1, layer.hidden_size // max(1, layer.head_dim))
        kv_fp32 = layer.kv_bytes * 4 // max(1, self.fp.itemsize)
        per_cold_row = 2 * layer.residual_bytes + layer.kv_bytes + kv_fp32 + heads * rows * 12
        return rows * per_cold_row + 2 * rows * heads * rows * 12


def _visible(layer: LayerFootprint, n_tokens: int) -> int:
    if layer.is_sliding and layer.sliding_window is not None:
        return min(n_tokens, layer.sliding_window)
    return n_tokens
