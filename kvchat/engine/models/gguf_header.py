"""A GGUF file's metadata and tensor table, read in one pass without its arrays.

gguf's ``GGUFReader`` builds a numpy view for every element of every array, which is slow
for a large vocabulary (Gemma 3's 262K tokens, their scores and types). The conversion needs
only scalars and the tensor table: this reader walks past arrays, keeping each one's first
element, and gives each tensor the type, shape, byte offset and numpy view GGUFReader gives
it (tests/engine/models/test_gguf_header.py checks both against GGUFReader on real files).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GgufHeader", "GgufTensor", "read_header", "write_config_view"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
SCALARS = {  # GGUF value type -> struct format
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip
# Tensor types GGUFReader views as elements; every other type is a uint8 view of its bytes.
ELEMENT_DTYPES = {0: "<f4", 1: "<f2", 24: "|i1", 25: "<i2", 26: "<i4", 27: "<i8", 28: "<f8"}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: int
    shape: tuple[int, ...]  # GGUF's order: the row length first
    n_bytes: int
    data_offset: int
    dtype: str  # numpy's dtype.str of the view GGUFReader gives the data
    data_shape: tuple[int, ...]


@dataclass(frozen=True)
class GgufHeader:
    metadata: dict[str, Any]
    tensors: list[GgufTensor]
    version: int
    entries: dict[str, tuple[int, int]]  # key -> its entry's byte span in the file
    lengths: dict[str, int]  # array key -> element count

    def value(self, key: str) -> Any:
        """A scalar's value, an array's first element, or None when the file lacks it."""
        return self.metadata.get(key)


class _Cursor:
    def __init__(self, data: Any) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("Q")
        start, self.pos = self.pos, self.pos + length
        return bytes(self.data[start : self.pos]).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.pos += 8 + struct.unpack_from("<Q", self.data, self.pos)[0]

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item_kind, count = self.take("I"), self.take("Q")
            if count == 0:
                return None
            if item_kind in SCALARS:
                first = self.take(SCALARS[item_kind])
                self.pos += (count - 1) * struct.calcsize(SCALARS[item_kind])
                return first
            first = self.value(item_kind)
            if item_kind == STRING:
                self.skip_strings(count - 1)
            else:
                for _ in range(count - 1):
                    self.value(item_kind)
            return first
        if kind not in SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.take(SCALARS[kind])


def read_header(path: str | Path) -> GgufHeader:
    """The metadata and tensor table of the GGUF at ``path`` (little-endian, version 2 or 3)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as m:
        cursor = _Cursor(m)
        if bytes(m[:4]) != MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        cursor.pos = 4
        version = cursor.take("I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (a big-endian file?)")
        tensor_count, kv_count = cursor.take("Q"), cursor.take("Q")
        metadata: dict[str, Any] = {}
        entries: dict[str, tuple[int, int]] = {}
        lengths: dict[str, int] = {}
        for _ in range(kv_count):
            start = cursor.pos
            key = cursor.string()
            kind = cursor.take("I")
            if kind == ARRAY:
                lengths[key] = struct.unpack_from("<Q", m, cursor.pos + 4)[0]
            metadata[key] = cursor.value(kind)
            entries[key] = (start, cursor.pos)
        table = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
            table.append((name, dims, cursor.take("I"), cursor.take("Q")))
        alignment = int(metadata.get("general.alignment") or DEFAULT_ALIGNMENT)
        start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in table:
        n_elements = 1
        for n in dims:
            n_elements *= n
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        data_shape = tuple(reversed(dims))
        dtype = ELEMENT_DTYPES.get(kind)
        if dtype is None:
            dtype = "|u1"
            data_shape = tuple(quant_shape_to_byte_shape(data_shape, GGMLQuantizationType(kind)))
        tensors.append(
            GgufTensor(
                name=name,
                tensor_type=kind,
                shape=dims,
                n_bytes=n_elements * type_size // block,
                data_offset=start + offset,
                dtype=dtype,
                data_shape=data_shape,
            )
        )
    return GgufHeader(metadata, tensors, version, entries, lengths)


# What transformers keeps of these is the tokenizer (and the vocabulary's size): parsing
# them element by element is what made its config read slow for a large vocabulary.
VOCABULARY_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)


def write_config_view(source: str | Path, header: GgufHeader, target: Path) -> None:
    """Write at ``target`` a GGUF that transformers reads the same config from as
    ``source``, in a fraction of the time: every metadata entry but the vocabulary arrays,
    with ``{arch}.vocab_size`` added as their length where the file lacks it (transformers
    takes the size from the token list then), and each tensor named with no data (the config
    reads tensor names only: a tied head, biases)."""
    arch = header.value("general.architecture")
    extra = b""
    vocab_key = f"{arch}.vocab_size"
    if vocab_key not in header.metadata and "tokenizer.ggml.tokens" in header.lengths:
        count = header.lengths["tokenizer.ggml.tokens"]
        extra = _string(vocab_key) + struct.pack("<II", 4, count)  # a uint32
    kept = [span for key, span in header.entries.items() if key not in VOCABULARY_ARRAYS]
    with open(source, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as m:
        parts = [bytes(m[start:end]) for start, end in kept]
    count = len(kept) + (1 if extra else 0)
    out = [MAGIC, struct.pack("<IQQ", header.version, len(header.tensors), count), *parts, extra]
    for tensor in header.tensors:  # one dimension of 0 elements, float32, at offset 0
        out.append(_string(tensor.name) + struct.pack("<IQIQ", 1, 0, 0, 0))
    body = b"".join(out)
    alignment = int(header.value("general.alignment") or DEFAULT_ALIGNMENT)
    Path(target).write_bytes(body + b"\0" * (-len(body) % alignment))


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw
