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

from kvchat.ui.format import bar, fmt_bytes, fmt_ratio

LABEL_W = 9
VALUE_W = 21
SIDE_W = 18
MAX_BAR = 60


def state_style(state: int, ceiling: int | None) -> str:
    if not ceiling:
        return "green"
    if state > ceiling:
        return "bold red"
    return "yellow" if state >= 0.85 * ceiling else "green"


class MemoryGauge(Widget):
    memory: reactive[dict[str, Any] | None] = reactive(None, always_update=True, layout=False)
    rss: reactive[int | None] = reactive(None)
    live: reactive[bool] = reactive(False)

    def __init__(self, ceiling: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ceiling = ceiling
        self.weights: int | None = None
        self.updates = 0  # how many snapshots it has shown (the tests count them)
        self.border_title = "memory"

    def show(self, memory: dict[str, Any]) -> None:
        self.updates += 1
        if memory.get("rss_bytes") is not None:
            self.rss = memory["rss_bytes"]
        if memory.get("weights_bytes"):
            self.weights = memory["weights_bytes"]
        self.memory = dict(memory)

    def watch_live(self, live: bool) -> None:
        self.border_title = "memory · live" if live else "memory"

    def render(self) -> Group:
        mem = self.memory or {}
        width = max(self.content_region.width, 20)
        ceiling = mem.get("ceiling_bytes", self.ceiling)
        state = mem.get("state_bytes", 0)
        standard = mem.get("standard_equivalent_bytes", 0)
        weights = mem.get("weights_bytes") or self.weights
        rss = self.rss
        wide = width >= LABEL_W + VALUE_W + SIDE_W + 14
        side = SIDE_W if wide else 0
        bar_w = min(MAX_BAR, width - LABEL_W - VALUE_W - side - 2)
        top = max(ceiling or 0, state, standard, 1)

        state_val = fmt_bytes(state) + (f" / {fmt_bytes(ceiling)}" if ceiling else "")
        rows = [
            (
                "kvchat",
                state,
                state_style(state, ceiling),
                state_val,
                f"weights {fmt_bytes(weights)}",
            ),
            ("standard", standard, "dodger_blue1", fmt_bytes(standard), f"RSS {fmt_bytes(rss)}"),
        ]
        lines = []
        for label, value, style, value_text, side_text in rows:
            filled, empty = bar(value / top, bar_w)
            line = Text(f"{label:<{LABEL_W}}", style="bold")
            line.append(filled, style=style)
            line.append(empty, style="grey35")
            line.append(f" {value_text:<{VALUE_W}}")
            if wide:
                line.append(f"{side_text:>{side}}", style="dim")
            lines.append(line)

        tokens = mem.get("tokens", 0)
        info = (
            f"{tokens} tokens: {mem.get('hot_tokens', 0)} hot · "
            f"{mem.get('checkpointed_tokens', 0)} checkpointed · "
            f"{fmt_bytes(mem.get('disk_bytes', 0))} disk · "
            f"recompute {100 * mem.get('recompute_share', 0.0):.0f}%"
        )
        if standard:
            info += f" · {fmt_ratio(state, standard)} std"
        if not wide:
            info += f" · weights {fmt_bytes(weights)} · RSS {fmt_bytes(rss)}"
        third = Text(info, style="dim", no_wrap=True, overflow="ellipsis")
        third.truncate(width, overflow="ellipsis")
        lines.append(third)
        return Group(*lines)
