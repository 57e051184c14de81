"""Sizes and one-line messages, shared by every front end."""

from __future__ import annotations

import pytest

from kvchat.units import error_line, human_bytes, one_line, parse_size, precise_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("64MB", 64_000_000), ("512KiB", 524_288), ("1.5GB", 1_500_000_000), ("4096", 4096),
     (" 2 MiB ", 2 * 2**20), (None, None), (123, 123)],
)  # fmt: skip
def test_sizes_read_as_people_write_them(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MB", "-1MB", "12XB", "1.2.3MB"])
def test_a_size_that_cannot_be_read_says_how_to_write_one(text) -> None:
    with pytest.raises(ValueError, match="write it like 64MB"):
        parse_size(text)


def test_sizes_shown() -> None:
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(512) == "512 B"
    assert human_bytes(None) == "-" and human_bytes(None, unknown="—") == "—"
    assert human_bytes(20_000 * 2**20) == "19.5 GiB"
    assert precise_bytes(1152) == "1.125 KiB" and precise_bytes(512) == "512 B"


def test_messages_stay_on_one_line() -> None:
    assert one_line("a\n  b\tc") == "a b c"
    assert one_line("x" * 50, limit=10) == "xxxxxxx..."
    assert error_line(OSError("disk\nfull")) == "OSError: disk full"
    assert error_line(ValueError()) == "ValueError"
    assert error_line(RuntimeError("boom"), with_type=False) == "boom"
    assert len(error_line(RuntimeError("y" * 1000))) == 240
