"""A safetensors file written one tensor (or row piece) at a time, in any order."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from kvchat.engine.models.streamed_safetensors import StreamedSafetensors, TensorLayout

TENSORS = {
    "model.b.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "model.a.weight": torch.linspace(-1, 1, 5),
    "Z.upper": torch.ones(2, 2, dtype=torch.float32) * 3,
    # every dtype it takes, several of one element size (safetensors orders them by dtype)
    "ids": torch.arange(4),
    "a.f64": torch.tensor([0.25, 2.0], dtype=torch.float64),
    "b.i32": torch.tensor([7, -1], dtype=torch.int32),
    "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    "a.f16": torch.tensor([0.5], dtype=torch.float16),
    "0.i16": torch.tensor([3], dtype=torch.int16),
    "i8": torch.tensor([-3, 4], dtype=torch.int8),
    "c.u8": torch.tensor([250], dtype=torch.uint8),
    "flag": torch.tensor([True, False, True]),
}


def _layouts() -> dict[str, TensorLayout]:
    return {
        name: TensorLayout(str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for name, t in TENSORS.items()
    }


def _bytes_of(t: torch.Tensor) -> memoryview:
    # numpy has no bfloat16: hand over the raw bytes, as for any tensor
    return memoryview(t.contiguous().view(torch.uint8).numpy())


@pytest.mark.parametrize("metadata", [None, {"model.embed.weight": "lm_head.weight"}])
def test_the_file_has_save_files_bytes_whatever_the_order_of_writing(
    tmp_path: Path, metadata: dict[str, str] | None
) -> None:
    expected = tmp_path / "expected.safetensors"
    safetensors.torch.save_file(TENSORS, str(expected), metadata=metadata)
    streamed = tmp_path / "streamed.safetensors"
    with StreamedSafetensors(streamed, _layouts(), metadata) as out:
        for name in reversed(list(TENSORS)):
            t = TENSORS[name]
            out.write(name, _bytes_of(t), str(t.dtype).removeprefix("torch."), tuple(t.shape))
    assert streamed.read_bytes() == expected.read_bytes()
    loaded = safetensors.torch.load_file(str(streamed))
    assert all(torch.equal(loaded[n], t) for n, t in TENSORS.items())


def test_a_tensor_written_in_row_pieces_is_the_whole_tensor(tmp_path: Path) -> None:
    big = torch.randn(10, 6)
    layouts = {"big": TensorLayout("float32", (10, 6)), "small": TensorLayout("float32", (2,))}
    path = tmp_path / "pieces.safetensors"
    with StreamedSafetensors(path, layouts) as out:
        out.check_part("big", "float32", (10, 6))
        for start in range(0, 10, 3):
            out.write_part("big", start * 6 * 4, big[start : start + 3].numpy())
        out.write("small", torch.zeros(2).numpy(), "float32", (2,))
    assert torch.equal(safetensors.torch.load_file(str(path))["big"], big)


def test_mistakes_are_refused(tmp_path: Path) -> None:
    layouts = {"w": TensorLayout("float32", (2, 2)), "v": TensorLayout("float32", (3,))}
    out = StreamedSafetensors(tmp_path / "bad.safetensors", layouts)
    with pytest.raises(KeyError, match="not announced"):
        out.write("nope", torch.zeros(1).numpy(), "float32", (1,))
    with pytest.raises(ValueError, match="announced float32 \\(2, 2\\)"):
        out.write("w", torch.zeros(4).numpy(), "float32", (4,))
    with pytest.raises(ValueError, match="does not continue"):
        out.write_part("w", 8, torch.zeros(2).numpy())  # a gap before it
    out.write("w", torch.zeros(2, 2).numpy(), "float32", (2, 2))
    with pytest.raises(ValueError, match="written twice"):
        out.write("w", torch.zeros(2, 2).numpy(), "float32", (2, 2))
    with pytest.raises(ValueError, match="never written, e.g. v"):
        out.close()
    with pytest.raises(ValueError, match="no dtype"):
        TensorLayout("complex64", (1,))
