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

__all__ = ["TensorWriter", "read_header", "read_tensors"]


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
    entries, _meta, start = read_header(path)
    wanted = entries if names is None else {n: entries[n] for n in names}
    ordered = sorted(wanted.items(), key=lambda item: item[1]["data_offsets"][0])
    with open(path, "rb", buffering=0) as fh:
        for name, entry in ordered:
            begin, end = entry["data_offsets"]
            dtype = _DTYPES[entry["dtype"]]
            raw = torch.empty(end - begin, dtype=torch.uint8)
            fh.seek(start + begin)
            view = memoryview(raw.numpy())
            got = 0
            while got < len(view):
                n = fh.readinto(view[got:])
                if not n:
                    raise OSError(f"{path.name} ends inside tensor {name!r}")
                got += n
            yield name, raw.view(dtype).reshape(entry["shape"])


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
