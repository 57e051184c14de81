"""kvchat's one-pass GGUF header reader against gguf's own ``GGUFReader``: every scalar,
every array's first element, and every tensor's type, shape, offset and view, on the real
GGUFs kvchat fetches and on written ones of several tensor types. And the config view:
transformers reads the same config from it as from the file."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvchat.engine.models.gguf_header import read_header, write_config_view
from tests.engine.models.test_models import write_tiny_gguf


def gguf_readers_view(path: Path) -> tuple[dict, list[dict]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or not field.data:
            continue
        value = field.parts[field.data[0]]
        if field.types[-1].name == "STRING":
            metadata[key] = bytes(value).decode("utf-8")
        else:
            metadata[key] = value.tolist()[0]
    tensors = [
        {
            "name": t.name,
            "type": int(t.tensor_type),
            "shape": tuple(int(n) for n in t.shape.tolist()),
            "n_bytes": int(t.n_bytes),
            "offset": int(t.data_offset),
            "dtype": t.data.dtype.str,
            "data_shape": tuple(int(n) for n in t.data.shape),
        }
        for t in reader.tensors
    ]
    return metadata, tensors


def assert_the_config_views_config_is_the_files(path: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    from kvchat.engine.models.gguf import rope_overrides

    header = read_header(path)
    view = tmp_path / "view" / path.name
    view.parent.mkdir()
    write_config_view(path, header, view)
    assert view.stat().st_size < 2**20
    overrides = rope_overrides(header)
    expected = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, **overrides)
    got = AutoConfig.from_pretrained(view.parent, gguf_file=view.name, **overrides)
    assert got.to_json_string() == expected.to_json_string()


def assert_same_as_gguf_reader(path: Path) -> None:
    header = read_header(path)
    metadata, tensors = gguf_readers_view(path)
    assert {k: v for k, v in header.metadata.items() if v is not None} == metadata
    assert [
        {
            "name": t.name,
            "type": t.tensor_type,
            "shape": t.shape,
            "n_bytes": t.n_bytes,
            "offset": t.data_offset,
            "dtype": t.dtype,
            "data_shape": t.data_shape,
        }
        for t in header.tensors
    ] == tensors


@pytest.mark.parametrize(
    ("embedding_type", "linear_type"),
    [(None, None), ("Q4_0", "Q4_1"), ("Q8_0", "Q5_0"), ("F16", "BF16")],
)
def test_written_ggufs_read_as_gguf_reads_them(tmp_path, embedding_type, linear_type):
    path = write_tiny_gguf(
        tmp_path / "tiny.gguf", embedding_type=embedding_type, linear_type=linear_type
    )
    assert_same_as_gguf_reader(path)
    assert "llama.vocab_size" in read_header(path).metadata  # the view keeps it
    assert_the_config_views_config_is_the_files(path, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma-3-270m"])
def test_the_fetched_ggufs_read_as_gguf_reads_them_in_a_fraction_of_the_time(model, tmp_path):
    from kvchat.engine.models.gguf_weights import gguf_path
    from kvchat.engine.models.resolve import resolve_model

    path = gguf_path(resolve_model(model).path)
    started = time.perf_counter()
    header = read_header(path)
    ours = time.perf_counter() - started
    assert header.value("general.architecture") in ("llama", "gemma3")
    assert header.value("tokenizer.ggml.tokens") is not None  # an array's first element
    started = time.perf_counter()
    assert_same_as_gguf_reader(path)
    assert ours < (time.perf_counter() - started) / 5
    # Gemma 3's file has no vocab_size: the view states the token list's length instead.
    assert_the_config_views_config_is_the_files(path, tmp_path)
