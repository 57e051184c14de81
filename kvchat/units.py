"""Units and text, once for every part of kvchat: sizes read and shown, messages kept to one
line, the process's RSS. Imports nothing heavy (psutil inside the one function using it)."""

from __future__ import annotations

__all__ = ["error_line", "human_bytes", "one_line", "parse_size", "precise_bytes", "process_rss"]

_SIZE_UNITS = {
    "": 1, "B": 1,
    "K": 1000, "KB": 1000, "KIB": 1024,
    "M": 10**6, "MB": 10**6, "MIB": 2**20,
    "G": 10**9, "GB": 10**9, "GIB": 2**30,
    "T": 10**12, "TB": 10**12, "TIB": 2**40,
}  # fmt: skip


def parse_size(text: str | int | None) -> int | None:
    """``"64MB"``, ``"512KiB"``, ``"1.5GB"``, ``4096`` -> bytes (MB = 10^6, MiB = 2^20)."""
    if text is None or isinstance(text, int):
        return text
    s = text.strip().replace(" ", "")
    i = len(s)
    while i > 0 and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    number, unit = s[:i], s[i:].upper()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or value < 0:
        raise ValueError(f"cannot read size {text!r}; write it like 64MB, 512KiB or 1.5GB")
    return int(value * _SIZE_UNITS[unit])


def human_bytes(n: float | None, unknown: str = "-") -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units up to PiB, then whole PiB in thousands;
    ``unknown`` for None."""
    if n is None:
        return unknown
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    for unit in units:
        if abs(n) < 1024 or unit == units[-1]:
            break
        n /= 1024
    if unit == "B":
        return f"{n:.0f} B"
    return f"{n:,.0f} {unit}" if abs(n) >= 10_000 else f"{n:.1f} {unit}"


def precise_bytes(n: float) -> str:
    """``1152`` -> ``"1.125 KiB"``, ``512`` -> ``"512 B"`` (binary units, 4 significant
    digits: per-token sizes, where one decimal would hide the difference)."""
    if n < 1024:
        return f"{n:.4g} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.4g} {unit}"


def one_line(text: object, limit: int | None = None) -> str:
    """``text`` with every whitespace run (newlines included) collapsed to one space, cut to
    ``limit`` characters with an ellipsis."""
    line = " ".join(str(text).split())
    if limit is not None and len(line) > limit:
        line = line[: limit - 3] + "..."
    return line


def error_line(exc: BaseException, limit: int = 240, with_type: bool = True) -> str:
    """An exception as one line for a user: ``"OSError: disk full"``, or the type's name
    alone when it has no message."""
    text = one_line(exc)
    name = type(exc).__name__
    if not text:
        return name
    return one_line(f"{name}: {text}" if with_type else text, limit)


def process_rss() -> int:
    """This process's resident set size in bytes, as the OS counts it."""
    import psutil

    return psutil.Process().memory_info().rss
