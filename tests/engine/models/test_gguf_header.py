"""kvchat's one-pass GGUF header reader against gguf's own ``GGUFReader``: every scalar,
every array's first element, and every tensor's type, shape, offset and view, on the real
GGUFs kvchat fetches and on written ones of several tensor types."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvchat.engine.models.gguf_header import read_header
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


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma-3-270m"])
def test_the_fetched_ggufs_read_as_gguf_reads_them_in_a_fraction_of_the_time(model):
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
