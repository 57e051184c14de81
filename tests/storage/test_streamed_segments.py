"""Segments written piece by piece (the disk tier's checkpoints never held whole)."""

from __future__ import annotations

import errno
import hashlib
import os

import pytest
import torch
from safetensors.torch import load_file

from kvchat.storage import atomic
from kvchat.storage.segments import StreamedTensor, tensor_layout, write_segment_stream
from tests.storage.test_atomic import FailingOs


def pieces_of(t: torch.Tensor, rows: int):
    def chunks():
        for r in range(0, t.shape[1], rows):
            yield memoryview(t[:, r : r + rows].contiguous().reshape(-1).view(torch.uint8).numpy())

    return chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_segment_is_a_safetensors_file_with_the_right_checksum(tmp_path, dtype):
    big = torch.randn(1, 300, 48).to(dtype)
    tensors = {
        "L0.residual": StreamedTensor(dtype, tuple(big.shape), pieces_of(big, 64)),
        "L0.calls": torch.tensor([256, 44]),
        "L0.first": torch.tensor([0]),
    }
    path = tmp_path / "turn-0001.safetensors"
    info = write_segment_stream(path, tensors)
    data = path.read_bytes()
    assert info.nbytes == len(data) and info.sha256 == hashlib.sha256(data).hexdigest()
    loaded = load_file(path)
    assert torch.equal(loaded["L0.residual"], big) and loaded["L0.calls"].tolist() == [256, 44]
    where = tensor_layout(path)["L0.residual"]
    assert (where.dtype, where.shape, where.nbytes) == (
        dtype,
        (1, 300, 48),
        big.numel() * big.element_size(),
    )
    raw = data[where.offset : where.offset + where.nbytes]
    assert raw == big.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert os.listdir(tmp_path) == [path.name]


def test_a_stream_that_produces_too_few_bytes_is_refused_and_leaves_nothing(tmp_path):
    short = StreamedTensor(torch.float32, (1, 10, 4), lambda: iter([b"\0" * 12]))
    with pytest.raises(ValueError, match="expected 160"):
        write_segment_stream(tmp_path / "x.safetensors", {"t": short})
    assert os.listdir(tmp_path) == []


def test_disk_full_midway_leaves_no_partial_segment(tmp_path, monkeypatch):
    big = torch.randn(1, 200, 32)
    stream = StreamedTensor(torch.float32, tuple(big.shape), pieces_of(big, 16))
    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(atomic, "os", FailingOs(budget=4000, exc=full))
    with pytest.raises(OSError, match="No space"):
        write_segment_stream(tmp_path / "x.safetensors", {"t": stream})
    assert os.listdir(tmp_path) == []
