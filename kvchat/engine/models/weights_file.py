"""safetensors files read and written one tensor at a time, without memory-mapping.

Why not ``safetensors.safe_open``: it maps the whole file, and every page a read touches
stays in the process's RSS until the file is closed, so converting a 538 MB fp32 file tensor
by tensor would still peak at the whole file. Reading each tensor with ``readinto`` into
memory of its own keeps the peak at one tensor. Why not ``save_file``: it builds every
tensor's bytes before writing; this writer streams them. The format is plain safetensors
(8-byte header length, JSON header, raw little-endian data), so any safetensors reader opens
the files written here.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

__all__ = [
    "LazyTensor",
    "TensorWriter",
    "lazy_tensors",
    "read_exactly",
    "read_header",
    "read_tensors",
]


def read_header(path: Path) -> tuple[dict[str, dict], dict[str, str], int]:
    """``(entries, metadata, data_start)`` of a safetensors file."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    metadata = header.pop("__metadata__", None) or {}
    return header, metadata, 8 + length


def read_tensors(path: Path, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each tensor (or each of ``names``), in file order, each in
    memory of its own."""
    for lazy in lazy_tensors(path, names):
        yield lazy.name, lazy.read()


class LazyTensor:
    """One tensor of a safetensors file, read when asked: whole, or a block of rows at a
    time (so a vocabulary table can be converted without ever being held whole)."""

    def __init__(self, path: Path, name: str, entry: dict, data_start: int) -> None:
        self.path, self.name = path, name
        self.dtype: torch.dtype = _DTYPES[entry["dtype"]]
        self.shape: list[int] = list(entry["shape"])
        begin, end = entry["data_offsets"]
        self._begin, self.nbytes = data_start + begin, end - begin

    def read(self) -> torch.Tensor:
        return self._read_bytes(self._begin, self.nbytes).view(self.dtype).reshape(self.shape)

    def int4_parts(self, start: int = 0, count: int | None = None) -> None:
        """None: a safetensors tensor has no 4-bit codes of its own
        (``gguf_weights.GgufTensor.int4_parts`` has)."""
        return None

    def rows(self, block: int) -> Iterator[torch.Tensor]:
        """The tensor ``block`` rows (first dimension) at a time, each in memory of its own."""
        if not self.shape:
            yield self.read()
            return
        row_bytes = self.nbytes // max(self.shape[0], 1)
        for start in range(0, self.shape[0], block):
            n = min(block, self.shape[0] - start)
            raw = self._read_bytes(self._begin + start * row_bytes, n * row_bytes)
            yield raw.view(self.dtype).reshape([n, *self.shape[1:]])

    def _read_bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        raw = torch.empty(nbytes, dtype=torch.uint8)
        read_exactly(self.path, offset, memoryview(raw.numpy()), self.name)
        return raw


def read_exactly(path: Path, offset: int, into: memoryview, tensor: str) -> None:
    """Fill ``into`` with the file's bytes from ``offset`` (memory of its own, no map)."""
    with open(path, "rb", buffering=0) as fh:
        fh.seek(offset)
        got = 0
        while got < len(into):
            n = fh.readinto(into[got:])
            if not n:
                raise OSError(f"{Path(path).name} ends inside tensor {tensor!r}")
            got += n


def lazy_tensors(path: Path, names: list[str] | None = None) -> Iterator[LazyTensor]:
    """A :class:`LazyTensor` for each tensor (or each of ``names``), in file order."""
    entries, _meta, start = read_header(path)
    wanted = entries if names is None else {n: entries[n] for n in names}
    ordered = sorted(wanted.items(), key=lambda item: item[1]["data_offsets"][0])
    for name, entry in ordered:
        yield LazyTensor(Path(path), name, entry, start)


class TensorWriter:
    """Append tensors to a data file, then publish header + data as ``path`` atomically."""

    def __init__(self, path: Path, metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._data_path = self.path.with_name(f".tmp-{os.getpid()}-{self.path.name}.data")
        self._data = open(self._data_path, "wb")
        self._entries: dict[str, dict] = {}
        self._offset = 0
        self._metadata = dict(metadata or {})

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor.new_empty(0)
        nbytes = tensor.numel() * tensor.element_size()
        self._data.write(memoryview(raw.numpy()) if nbytes else b"")
        self._entries[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self._offset, self._offset + nbytes],
        }
        self._offset += nbytes

    def add_rows(
        self, name: str, dtype: torch.dtype, shape: list[int], blocks: Iterator[torch.Tensor]
    ) -> None:
        """Append one tensor given as consecutive blocks of rows (never held whole)."""
        nbytes = 0
        for block in blocks:
            block = block.detach().cpu().contiguous()
            if block.dtype != dtype:
                raise ValueError(f"{name}: a {block.dtype} block in a {dtype} tensor")
            raw = block.reshape(-1).view(torch.uint8)
            self._data.write(memoryview(raw.numpy()))
            nbytes += raw.numel()
        expected = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        if nbytes != expected:
            raise ValueError(f"{name}: {nbytes} bytes written for a {expected}-byte tensor")
        self._entries[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [self._offset, self._offset + nbytes],
        }
        self._offset += nbytes

    def publish(self) -> Path:
        self._data.close()
        header = dict(self._entries)
        header["__metadata__"] = self._metadata
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data aligned to 8 bytes, as safetensors writes it
        tmp = self.path.with_name(f".tmp-{os.getpid()}-{self.path.name}")
        try:
            with open(tmp, "wb") as out, open(self._data_path, "rb") as data:
                out.write(struct.pack("<Q", len(blob)))
                out.write(blob)
                shutil.copyfileobj(data, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        finally:
            self._data_path.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
        return self.path

    def abandon(self) -> None:
        self._data.close()
        self._data_path.unlink(missing_ok=True)
