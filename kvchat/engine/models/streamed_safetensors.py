"""Write a safetensors file one tensor at a time, in any order, never holding them all.

``safetensors.torch.save_file`` takes the whole state dict at once: for a converted model
that is a float32 copy of every weight in memory. The format only needs every tensor's
name, dtype and shape up front (the header); the data then goes at fixed offsets, so each
tensor can be written the moment it exists and dropped.

The bytes are those ``save_file`` writes for the same tensors and metadata (header keys in
data order, ``__metadata__`` first; data ordered by safetensors' dtype order, then by
name; header padded with spaces to 8 bytes), so a file written here is indistinguishable
from one written there (``tests/engine/models/test_streamed_safetensors.py`` compares them).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

__all__ = ["StreamedSafetensors", "TensorLayout"]

# torch dtype name -> (safetensors dtype, bytes per element)
_DTYPES = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}
# The order safetensors lays data out in: by its dtype enum, last first, then by name
# (tests/engine/models/test_streamed_safetensors.py checks it against save_file).
_DATA_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL")


class TensorLayout:
    """One tensor's place in the file: dtype (a torch dtype name), shape, byte range."""

    def __init__(self, dtype: str, shape: tuple[int, ...]) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"safetensors has no dtype for {dtype}")
        self.dtype = dtype
        self.shape = tuple(int(n) for n in shape)
        numel = 1
        for n in self.shape:
            numel *= n
        self.nbytes = numel * _DTYPES[dtype][1]
        self.start = 0


class StreamedSafetensors:
    """A safetensors file at ``path`` whose tensors are announced first and written later.

    ``layouts`` maps each name to its :class:`TensorLayout`. :meth:`write` takes one tensor
    (anything exposing the buffer protocol in C order: a contiguous numpy array or a CPU
    tensor's ``.numpy()``), :meth:`write_part` one in consecutive parts; :meth:`close`
    checks that every announced tensor was written whole.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layouts: dict[str, TensorLayout],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.layouts = layouts
        self._filled: dict[str, int] = {}  # bytes written so far, per tensor
        order = sorted(
            layouts, key=lambda name: (_DATA_ORDER.index(_DTYPES[layouts[name].dtype][0]), name)
        )
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = metadata
        offset = 0
        for name in order:
            layout = layouts[name]
            layout.start = offset
            header[name] = {
                "dtype": _DTYPES[layout.dtype][0],
                "shape": list(layout.shape),
                "data_offsets": [offset, offset + layout.nbytes],
            }
            offset += layout.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.data_start = 8 + len(text)
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(struct.pack("<Q", len(text)) + text)
        self._file.truncate(self.data_start + offset)

    def write(self, name: str, data: Any, dtype: str, shape: tuple[int, ...]) -> None:
        """Put tensor ``name`` (of ``dtype`` and ``shape``, which must match what was
        announced) in its place."""
        layout = self._layout(name, dtype, shape)
        if name in self._filled:
            raise ValueError(f"{name} was written twice")
        self.write_part(name, 0, data)
        if self._filled[name] != layout.nbytes:
            raise ValueError(f"{name}: {self._filled[name]} bytes, announced {layout.nbytes}")

    def check_part(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        """Whether ``name`` was announced with ``dtype`` and ``shape`` (ValueError if not),
        before it is written in parts."""
        self._layout(name, dtype, shape)

    def write_part(self, name: str, offset: int, data: Any) -> None:
        """Put the bytes of ``data`` at byte ``offset`` of tensor ``name``: a tensor written in
        consecutive parts (rows) never has to exist whole."""
        layout = self.layouts.get(name)
        if layout is None:
            raise KeyError(f"{name} was not announced")
        view = memoryview(data).cast("B")
        if offset != self._filled.get(name, 0) or offset + view.nbytes > layout.nbytes:
            raise ValueError(f"{name}: a part at byte {offset} does not continue what was written")
        self._file.seek(self.data_start + layout.start + offset)
        self._file.write(view)
        self._filled[name] = offset + view.nbytes

    @property
    def written(self) -> set[str]:
        """The tensors written whole so far."""
        return {n for n, size in self._filled.items() if size == self.layouts[n].nbytes}

    def _layout(self, name: str, dtype: str, shape: tuple[int, ...]) -> TensorLayout:
        layout = self.layouts.get(name)
        if layout is None:
            raise KeyError(f"{name} was not announced")
        if (dtype, tuple(shape)) != (layout.dtype, layout.shape):
            raise ValueError(
                f"{name}: got {dtype} {tuple(shape)}, announced {layout.dtype} {layout.shape}"
            )
        return layout

    def close(self) -> None:
        """Flush and close; ValueError if an announced tensor was never written."""
        self._file.close()
        missing = sorted(set(self.layouts) - self.written)
        if missing:
            raise ValueError(f"{len(missing)} tensors were never written, e.g. {missing[0]}")

    def __enter__(self) -> StreamedSafetensors:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._file.close()
