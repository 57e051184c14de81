"""Streaming detokenization: token by token equals decoding the whole reply, never a partial
character, never a stop string shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.engine.chat.detokenizer import IncrementalDecoder, StopStrings


class ByteTokenizer:
    """One token per UTF-8 byte, so any character can be split across tokens; counts the
    tokens it decodes (the cost the incremental decoder exists to bound)."""

    def __init__(self) -> None:
        self.decoded_tokens = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_tokens += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


TEXT = "Héllo, wörld! 東京は晴れ 🌍🚀 – done."


def test_multibyte_characters_split_across_tokens_are_emitted_whole() -> None:
    tok = ByteTokenizer()
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in tok.encode(TEXT)]
    pieces.append(decoder.flush())
    assert "".join(pieces) == TEXT == decoder.text
    assert all("\ufffd" not in p for p in pieces)
    # The 4-byte emoji arrives as 4 tokens: nothing until its last byte, then all of it.
    emoji = [decoder2 for decoder2 in pieces if "🌍" in decoder2]
    assert emoji == ["🌍"]


def test_cost_per_token_does_not_grow_with_the_reply() -> None:
    tok = ByteTokenizer()
    decoder = IncrementalDecoder(tok)
    for i in tok.encode("a" * 2000):
        decoder.push(i)
    # Decoding the whole reply at each token would touch ~2,000,000 tokens.
    assert tok.decoded_tokens < 10 * 2000


def test_a_truncated_character_is_flushed_as_a_replacement() -> None:
    tok = ByteTokenizer()
    decoder = IncrementalDecoder(tok)
    out = "".join(decoder.push(i) for i in "ok 🌍".encode()[:-1])
    assert out == "ok "
    assert decoder.flush() == "\ufffd"


def test_stop_string_is_never_shown_even_in_part() -> None:
    stops = StopStrings(("\nUser:", "\nuser:"))
    shown = []
    for piece in ["Paris is", " the capital.", "\n", "Us", "er", ": and more"]:
        text, stopped = stops.feed(piece)
        shown.append(text)
        if stopped:
            break
    assert "".join(shown) == "Paris is the capital."
    assert stopped and stops.feed("later")[0] == ""


def test_a_held_back_tail_that_never_completes_is_flushed() -> None:
    stops = StopStrings(("\nUser:",))
    text, stopped = stops.feed("The end\nUs")
    assert (text, stopped) == ("The end", False)
    assert stops.feed("ually")[0] == "\nUsually"
    stops.feed("\nU")
    assert stops.flush() == "\nU"


def test_stop_string_inside_one_piece() -> None:
    stops = StopStrings(("\nUser:",))
    assert stops.feed("yes\nUser: no") == ("yes", True)


@pytest.mark.slow
def test_real_tokenizer_token_by_token_equals_whole_decode(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok(TEXT + " Ça va? naïve café 🙂 <|im_end|>", add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)
