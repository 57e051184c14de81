"""The live memory gauge: conversation state against the ceiling, beside the standard cache.

Three lines: kvchat's resident state on a bar scaled to the ``--max-mem`` ceiling (or to the
larger of the two readings when there is none), the standard-cache equivalent for the same
tokens on the same scale, and the token breakdown. Weights and process RSS sit at the right
(below, when the gauge is narrow). It renders whatever snapshot it was last given; the app
feeds it from the streaming worker several times a second.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from kvchat.engine.chat.memory_snapshot import MemorySnapshot
from kvchat.ui.format import bar, count, fmt_bytes, fmt_ratio

LABEL_W = 9
VALUE_W = 21  # "999.9 KiB / 999.9 KiB": kept steady so the bar does not jitter as it streams
GAP = 3  # spaces between a reading and the weights/RSS figure beside it
SIDE_W = 18
MIN_BAR = 10
MAX_BAR = 60


def state_style(state: int, ceiling: int | None) -> str:
    if not ceiling:
        return "green"
    if state > ceiling:
        return "bold red"
    return "yellow" if state >= 0.85 * ceiling else "green"


class MemoryGauge(Widget):
    memory: reactive[MemorySnapshot | None] = reactive(None, always_update=True, layout=False)
    rss: reactive[int | None] = reactive(None)
    live: reactive[bool] = reactive(False)

    def __init__(self, ceiling: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ceiling = ceiling
        self.weights: int | None = None
        self.updates = 0  # how many snapshots it has shown (the tests count them)
        self.border_title = "memory"

    def show(self, memory: MemorySnapshot) -> None:
        self.updates += 1
        if memory.rss_bytes is not None:
            self.rss = memory.rss_bytes
        if memory.weights_bytes:
            self.weights = memory.weights_bytes
        self.memory = memory

    def watch_live(self, live: bool) -> None:
        self.border_title = "memory · live" if live else "memory"

    def clear(self) -> None:
        """Forget the readings (another model is loading: its figures are not these)."""
        self.weights = None
        self.memory = None

    def render(self) -> Group:
        # Before the first reading: zeros against the launch ceiling.
        mem = self.memory or MemorySnapshot(ceiling_bytes=self.ceiling)
        width = max(self.content_region.width, 20)
        ceiling = mem.ceiling_bytes
        state = mem.state_bytes
        standard = mem.standard_equivalent_bytes
        weights = mem.weights_bytes or self.weights
        rss = self.rss

        state_val = fmt_bytes(state) + (f" / {fmt_bytes(ceiling)}" if ceiling else "")
        values = [state_val, fmt_bytes(standard)]
        sides = [f"weights {fmt_bytes(weights)}", f"RSS {fmt_bytes(rss)}"]
        value_w = max(VALUE_W if ceiling else 9, *(len(v) for v in values))
        side_w = max(SIDE_W, *(len(t) for t in sides))
        # The weights/RSS column only where the bar keeps a useful length beside it;
        # otherwise those figures move to the third line.
        bar_w = width - LABEL_W - 1 - value_w - GAP - side_w
        wide = bar_w >= MIN_BAR
        if not wide:
            bar_w = width - LABEL_W - 1 - value_w
        bar_w = max(1, min(MAX_BAR, bar_w))
        top = max(ceiling or 0, state, standard, 1)

        rows = [
            ("kvchat", state, state_style(state, ceiling), values[0], sides[0]),
            ("standard", standard, "dodger_blue1", values[1], sides[1]),
        ]
        lines = []
        for label, value, style, value_text, side_text in rows:
            filled, empty = bar(value / top, bar_w)
            line = Text(f"{label:<{LABEL_W}}", style="bold")
            line.append(filled, style=style)
            line.append(empty, style="grey35")
            line.append(f" {value_text:<{value_w}}")
            if wide:
                line.append(" " * GAP + f"{side_text:>{side_w}}", style="dim")
            lines.append(line)

        tokens = mem.tokens
        info = (
            f"{count(tokens, 'token')}: {mem.hot_tokens} hot · "
            f"{mem.checkpointed_tokens} checkpointed · "
            f"{fmt_bytes(mem.disk_bytes)} disk · "
            f"recompute {100 * mem.recompute_share:.0f}%"
        )
        if standard:
            info += f" · {fmt_ratio(state, standard)} std"
        if not wide:
            info += f" · weights {fmt_bytes(weights)} · RSS {fmt_bytes(rss)}"
        third = Text(info, style="dim", no_wrap=True, overflow="ellipsis")
        third.truncate(width, overflow="ellipsis")
        lines.append(third)
        return Group(*lines)
