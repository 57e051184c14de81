"""What to hold where under ``--max-mem``: the cold form per layer and the hot window B.

The planner works from the per-layer bytes of ``footprint.py`` and re-plans before every
forward call, because B must shrink as the conversation grows: conversation state is

    sum over residual-form layers of  tokens_kept * residual + min(B, tokens) * kv
  + sum over kv-form layers of        tokens_kept * kv
  + recompute scratch (one layer's K/V for the tokens it attends to, plus the copy handed
    to attention) whenever anything is recomputed
  + token ids (8 bytes each)

where sliding-window layers keep at most about one window of tokens. The largest B whose
state fits is chosen. If even B = 0 does not fit, the checkpoints themselves are over the
ceiling: the engine raises ``NeedsDiskTierError`` rather than drop context.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


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
        if self.ceiling is None:
            return None
        if self.estimate(n_tokens, None).total <= self.ceiling:
            return None
        floor = self.estimate(n_tokens, 0)
        if floor.total > self.ceiling:
            raise NeedsDiskTierError(
                f"{n_tokens} tokens need {human_bytes(floor.total)} of conversation state even "
                f"with every K/V recomputed (checkpoints {human_bytes(floor.checkpoints)}, "
                f"scratch {human_bytes(floor.scratch)}), over --max-mem "
                f"{human_bytes(self.ceiling)}; raise --max-mem or shorten the conversation "
                "(the disk tier is not available yet)"
            )
        lo, hi = 0, n_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.estimate(n_tokens, mid).total <= self.ceiling:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _visible(layer: LayerFootprint, n_tokens: int) -> int:
    if layer.is_sliding and layer.sliding_window is not None:
        return min(n_tokens, layer.sliding_window)
    return n_tokens
