"""Manifest (de)serialisation and validation."""

from __future__ import annotations

import json

import pytest

from kvchat.storage.manifest import (
    FORMAT_VERSION,
    Manifest,
    ManifestError,
    ModelInfo,
    NewerFormatError,
    SegmentInfo,
    Turn,
    make_title,
    segment_file_name,
    utc_now,
)


def sample() -> Manifest:
    now = utc_now()
    return Manifest(
        id="20261130-024512-3fa2",
        title="Hello",
        created=now,
        updated=now,
        model=ModelInfo(name="smollm2-135m", fingerprint="f" * 64, dtype="bfloat16"),
        settings={"system": "Be brief.", "sampling": {"temperature": 0.7}},
        messages=[
            {"role": "user", "content": 'Hello "world"\nsecond line — ünïcode'},
            {"role": "assistant", "content": "Hi."},
        ],
        token_ids=[1, 2, 3, 4],
        turns=[
            Turn(
                index=1,
                n_tokens_total_after=4,
                segment=SegmentInfo(file="turn-0001.safetensors", sha256="a" * 64, nbytes=10),
                extra={"chunks": [0, 4]},
            )
        ],
        engine_state={"boundaries": [0, 2, 4]},
    )


def parse(text: str) -> Manifest:
    return Manifest.from_json(text, source="/x/manifest.json", conv_id="C1")


def test_round_trip_is_exact_and_readable():
    m = sample()
    text = m.to_json()
    assert parse(text) == m
    assert json.loads(text)["format_version"] == FORMAT_VERSION
    # lists of plain values stay on one line; objects are indented one key per line
    assert '"token_ids": [1,2,3,4]' in text
    assert '\n  "title": "Hello",\n' in text
    assert "ünïcode" in text  # not \u-escaped


def damaged(mutate) -> str:
    data = sample().to_dict()
    mutate(data)
    return json.dumps(data)


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda d: d.pop("model"), "model missing"),
        (lambda d: d.__setitem__("turns", "x"), "turns has the wrong type"),
        (lambda d: d.__setitem__("token_ids", [1, "2"]), "token_ids holds a non-integer"),
        (lambda d: d["messages"].append({"role": "user"}), "messages[2].content missing"),
        (lambda d: d["turns"][0].__setitem__("index", 2), "index is 2, expected 1"),
        (lambda d: d["turns"][0]["segment"].__setitem__("file", "../x"), "segment.file"),
        (lambda d: d["turns"][0]["segment"].__setitem__("sha256", "zz"), "sha256"),
        (lambda d: d["turns"][0].__setitem__("n_tokens_total_after", 9), "past token_ids"),
        (lambda d: d.__setitem__("created", "yesterday"), "created is not an ISO-8601"),
        (lambda d: d.__setitem__("format_version", "1"), "format_version"),
        (lambda d: d.__setitem__("format_version", True), "format_version"),
    ],
)
def test_damaged_manifest_is_refused_with_one_line_naming_the_file(mutate, fragment):
    with pytest.raises(ManifestError) as err:
        parse(damaged(mutate))
    msg = str(err.value)
    assert fragment in msg
    assert "/x/manifest.json" in msg and "C1" in msg and "kvchat delete C1" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("text", ["", "{not json", "[1, 2]", "null"])
def test_not_a_manifest(text):
    with pytest.raises(ManifestError) as err:
        parse(text)
    assert "/x/manifest.json" in str(err.value)
    assert "\n" not in str(err.value)


def test_newer_format_is_refused_before_anything_else():
    # A future format may change every other field: only format_version is looked at.
    text = json.dumps({"format_version": FORMAT_VERSION + 1, "whatever": True})
    with pytest.raises(NewerFormatError) as err:
        parse(text)
    assert str(err.value) == (
        f"conversation C1 was saved by a newer kvchat (format {FORMAT_VERSION + 1} > "
        f"{FORMAT_VERSION}); upgrade kvchat to open it"
    )


def test_title_and_segment_names():
    assert make_title("  hello\n  world ") == "hello world"
    long = make_title("word " * 40)
    assert len(long) == 60 and long.endswith("…")
    assert segment_file_name(3) == "turn-0003.safetensors"
    assert segment_file_name(12345) == "turn-12345.safetensors"
