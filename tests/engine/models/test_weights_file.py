"""safetensors read and written a tensor, or a block of rows, at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvchat.engine.models.weights_file import TensorWriter, lazy_tensors


def test_rows_read_in_blocks_are_the_whole_tensor(tmp_path: Path) -> None:
    table = torch.randn(1003, 48).to(torch.bfloat16)
    save_file({"b": torch.arange(5), "table": table}, tmp_path / "m.safetensors")
    lazy = {t.name: t for t in lazy_tensors(tmp_path / "m.safetensors")}
    for block in (1, 64, 1000, 5000):
        assert torch.equal(torch.cat(list(lazy["table"].rows(block))), table)
    assert torch.equal(lazy["table"].read(), table)
    assert torch.equal(lazy["b"].read(), torch.arange(5))


def test_a_tensor_written_in_blocks_reads_back_with_safetensors(tmp_path: Path) -> None:
    table = torch.randint(-127, 127, (300, 16), dtype=torch.int8)
    writer = TensorWriter(tmp_path / "out.safetensors", {"format": "test"})
    writer.add("first", torch.ones(3))
    writer.add_rows("table", torch.int8, [300, 16], iter(table.split(128)))
    writer.publish()
    back = load_file(tmp_path / "out.safetensors")
    assert torch.equal(back["table"], table) and torch.equal(back["first"], torch.ones(3))


def test_blocks_that_do_not_add_up_are_refused(tmp_path: Path) -> None:
    writer = TensorWriter(tmp_path / "out.safetensors")
    with pytest.raises(ValueError, match="bytes written"):
        writer.add_rows("t", torch.int8, [10, 4], iter([torch.zeros(3, 4, dtype=torch.int8)]))
    writer.abandon()
    assert not list(tmp_path.iterdir())
