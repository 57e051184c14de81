"""Small text helpers for the gauge and the comparison panel: sizes, bars, sparklines.

Bars and sparklines are drawn here rather than with Textual's ``ProgressBar``/``Sparkline``
because the comparison needs one scale shared by several series (Textual's sparkline scales
each series to its own min..max, which would make a 10x difference look like none) and the
gauge must fit three readings into three lines at 80 columns.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvchat.units import human_bytes

__all__ = ["bar", "count", "fmt_bytes", "fmt_ratio", "sparkline"]

_EIGHTHS = " ▏▎▍▌▋▊▉"
_SPARKS = "▁▂▃▄▅▆▇█"


def fmt_bytes(n: float | None) -> str:
    """``human_bytes`` (the CLI's units), with a dash for unknown."""
    return "—" if n is None else human_bytes(n)


def count(n: int, noun: str) -> str:
    """``1 token``, ``2 tokens``, ``0 turns`` (nouns here take a plain -s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def fmt_ratio(num: float, den: float) -> str:
    return f"{num / den:.2f}x" if den else "—"


def bar(fraction: float, width: int) -> tuple[str, str]:
    """A horizontal bar ``width`` cells wide: ``(filled, empty)`` parts, in eighths."""
    width = max(0, width)
    f = min(max(fraction, 0.0), 1.0)
    eighths = round(f * width * 8)
    full, part = divmod(eighths, 8)
    filled = "█" * full + (_EIGHTHS[part] if part and full < width else "")
    return filled, "░" * (width - len(filled))


def sparkline(values: Sequence[float], top: float, width: int) -> str:
    """The last ``width`` values as block characters, scaled to ``top`` (shared by series)."""
    if width <= 0:
        return ""
    shown = list(values)[-width:]
    if not top or top <= 0:
        return _SPARKS[0] * len(shown)
    out = []
    for v in shown:
        level = round(min(max(v / top, 0.0), 1.0) * (len(_SPARKS) - 1))
        out.append(_SPARKS[level])
    return "".join(out)
