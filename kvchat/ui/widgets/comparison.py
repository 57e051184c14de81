"""Side-by-side comparison: kvchat's conversation state and the standard cache, turn by turn.

Sparklines share one scale per section, so their heights compare honestly (on a grouped-query
model kvchat's residual checkpoints can be *larger* than the standard cache; that should show).
Below them: where kvchat's state lives right now (hot K/V, checkpoints, disk, token ids,
recompute scratch), how much of the compute time went to recomputing K/V, and a table of
the last turns that fit. Every line adapts to the panel's width and height.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.widget import Widget

from kvchat.engine.chat.memory_snapshot import MemorySnapshot
from kvchat.ui.format import bar, fmt_bytes, fmt_ratio, sparkline

LABEL_W = 10
VALUE_W = 10
EMPTY = (
    "No turns yet. Send a message: kvchat's resident state and the standard cache "
    "for the same tokens are drawn here after every turn."
)


def per_turn(cumulative: list[float]) -> list[float]:
    """Increase of a cumulative figure over each turn."""
    out, previous = [], 0.0
    for value in map(float, cumulative):
        out.append(max(value - previous, 0.0))
        previous = value
    return out


class ComparisonPanel(Widget):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.turns: list[MemorySnapshot] = []
        self.live: MemorySnapshot | None = None
        self.border_title = "kvchat vs standard cache"

    def set_data(self, turns: list[MemorySnapshot], live: MemorySnapshot | None = None) -> None:
        self.turns = list(turns)
        self.live = live
        self.refresh()

    # -- rendering -------------------------------------------------------------------------
    def _points(self) -> list[MemorySnapshot]:
        return self.turns + ([self.live] if self.live is not None else [])

    def render(self) -> RenderableType:
        points = self._points()
        width = max(self.content_region.width, 24)
        height = max(self.content_region.height, 1)
        if not points:
            return Text(EMPTY, style="dim")
        now = points[-1]
        sections = [
            self._series(points, width),
            self._breakdown(now, width),
            self._time(points, width),
        ]
        lines = sum(len(s) for s in sections)
        # Blank lines between sections only when the table still gets a few rows.
        gap = [Text("")] if height - lines - 3 >= 2 + 4 else []
        parts: list[RenderableType] = []
        for section in sections:
            parts += [*section, *gap]
        rows_left = height - len(parts) - (0 if gap else 1)
        if rows_left >= 2 and self.turns:
            if not gap:
                parts.append(Text(""))
            parts.append(self._table(rows_left, width))
        return Group(*parts)

    def _spark_width(self, n: int, width: int) -> tuple[int, int]:
        room = max(width - LABEL_W - VALUE_W - 2, 4)
        per = max(1, min(3, room // max(n, 1)))
        return room, per

    def _row(self, label: str, middle: Text, value: str, width: int) -> Text:
        line = Text(f"{label:<{LABEL_W}}", style="bold")
        line.append_text(middle)
        pad = width - LABEL_W - len(middle) - VALUE_W
        line.append(" " * max(pad, 1))
        line.append(f"{value:>{VALUE_W}}")
        return line

    def _series(self, points: list[MemorySnapshot], width: int) -> list[Text]:
        state = [p.state_bytes for p in points]
        std = [p.standard_equivalent_bytes for p in points]
        tokens = [p.tokens for p in points]
        top = max(state + std + [1])
        room, per = self._spark_width(len(points), width)
        n = room // per

        def spark(values: list[float], scale: float, style: str) -> Text:
            line = sparkline(values, scale, n)
            return Text("".join(c * per for c in line), style=style)

        live = " (live)" if self.live is not None else ""
        head = Text(f"per turn{live}, one scale", style="bold italic grey62")
        now = points[-1]
        ratio = fmt_ratio(now.state_bytes, now.standard_equivalent_bytes)
        return [
            head,
            self._row("kvchat", spark(state, top, "green"), fmt_bytes(state[-1]), width),
            self._row("standard", spark(std, top, "dodger_blue1"), fmt_bytes(std[-1]), width),
            self._row("tokens", spark(tokens, max(tokens + [1]), "grey70"), str(tokens[-1]), width),
            self._row("ratio", Text("kvchat ÷ standard", style="dim"), ratio, width),
        ]

    def _breakdown(self, now: MemorySnapshot, width: int) -> list[Text]:
        tiers = [
            ("hot K/V", now.hot_tokens, now.hot_kv_bytes, "green"),
            ("checkpts", now.checkpointed_tokens, now.checkpoint_bytes, "cyan"),
            ("on disk", None, now.disk_bytes, "magenta"),
            ("token ids", None, now.token_id_bytes, "grey70"),
            ("scratch", None, now.scratch_peak_bytes, "yellow"),
        ]
        total = max(sum(t[2] for t in tiers), 1)
        tok_w = 9
        bar_w = max(width - LABEL_W - VALUE_W - tok_w - 1, 3)
        cache = now.cache or "kvdirect"
        hw = now.hot_window
        window = f", hot window {hw}" if hw is not None else ""
        lines = [Text(f"kvchat state now ({cache}{window})", style="bold italic grey62")]
        for label, toks, nbytes, style in tiers:
            filled, empty = bar(nbytes / total, bar_w)
            mid = Text(f"{'' if toks is None else f'{toks} tok':<{tok_w}}")
            mid.append(filled, style=style)
            mid.append(empty, style="grey23")
            lines.append(self._row(label, mid, fmt_bytes(nbytes), width))
        return lines

    def _time(self, points: list[MemorySnapshot], width: int) -> list[Text]:
        now = points[-1]
        compute = now.compute_seconds
        recompute = now.recompute_seconds
        shares = [
            r / c if c else 0.0
            for r, c in zip(
                per_turn([p.recompute_seconds for p in points]),
                per_turn([p.compute_seconds for p in points]),
            )
        ]
        room, per = self._spark_width(len(points), width)
        spark = Text("".join(c * per for c in sparkline(shares, 1.0, room // per)), style="yellow")
        share = f"{100 * now.recompute_share:.0f}%"
        return [
            Text("time spent recomputing K/V, per turn", style="bold italic grey62"),
            self._row("recompute", spark, share, width),
            Text(
                f"{recompute:.2f} s of {compute:.2f} s compute",
                style="dim",
                no_wrap=True,
                overflow="ellipsis",
            ),
        ]

    def _table(self, rows: int, width: int) -> Table:
        table = Table.grid(padding=(0, 1), expand=False)
        wide = width >= 56
        table.add_column("turn", justify="right", style="dim")
        table.add_column("tokens", justify="right")
        table.add_column("kvchat", justify="right", style="green")
        table.add_column("standard", justify="right", style="dodger_blue1")
        table.add_column("ratio", justify="right")
        if wide:
            table.add_column("hot", justify="right")
            table.add_column("ckpt", justify="right")
        header = ["turn", "tokens", "kvchat", "standard", "ratio"] + (
            ["hot", "ckpt"] if wide else []
        )
        table.add_row(*(Text(h, style="bold underline") for h in header))
        first = max(len(self.turns) - (rows - 1), 0)
        for i, t in enumerate(self.turns[first:], start=first + 1):
            state, std = t.state_bytes, t.standard_equivalent_bytes
            row = [
                str(i),
                str(t.tokens),
                fmt_bytes(state),
                fmt_bytes(std),
                fmt_ratio(state, std),
            ]
            if wide:
                row += [str(t.hot_tokens), str(t.checkpointed_tokens)]
            table.add_row(*row)
        return table
