"""Segment files: one safetensors file per turn, checked against a sha256 before use.

A segment is written once and never rewritten, so its checksum (kept in the manifest) is a
complete description of what the file must contain. Reading verifies it first: a truncated
or bit-flipped file must surface as a clear error naming the file, never as wrong tensors
fed silently to the engine.

Whole-turn reads (``read_segment``) hash and parse the same bytes read once. Lazy reads
(``iter_segment``, ``read_slice``) go through ``safe_open``; for those the file is hashed once
per process and the result remembered by (device, inode, size, mtime), so slicing a few rows
at a time costs a header parse and a small read, not a full-file hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.storage.atomic import write_atomic, write_atomic_stream
from kvchat.storage.manifest import SegmentCorruptedError, SegmentInfo
from kvchat.storage.safe_fs import UnsafePathError, check_regular, open_regular, read_regular
from kvchat.units import one_line

if TYPE_CHECKING:  # storage imports torch only inside the functions that handle tensors
    import torch

SEGMENT_METADATA = {"kvchat": "segment", "format": "1"}

_verified: dict[tuple[str, int, int, int, int], str] = {}
_verified_lock = threading.Lock()


def encode(tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, SegmentInfo]:
    """Serialise tensors to safetensors bytes and describe them (file name left empty).

    Done in memory before anything touches the disk so the checksum is of exactly the bytes
    written, and so a bad argument fails before a save starts.
    """
    import torch
    from safetensors.torch import save as st_save

    prepared: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        # safetensors wants dense, contiguous CPU memory; these are no-ops when already so.
        prepared[name] = tensor.detach().to("cpu").contiguous()
    data = st_save(prepared, metadata=SEGMENT_METADATA)
    return data, SegmentInfo(file="", sha256=hashlib.sha256(data).hexdigest(), nbytes=len(data))


_DTYPE_NAMES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "uint8": "U8",
}
"""torch dtype name (``str(torch.float32)`` without ``torch.``) -> safetensors dtype code."""


def _st_dtype(dtype: torch.dtype) -> str | None:
    return _DTYPE_NAMES.get(str(dtype).removeprefix("torch."))


@cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {code: getattr(torch, name) for name, code in _DTYPE_NAMES.items()}


@dataclass
class StreamedTensor:
    """A tensor written piece by piece: its bytes come from ``chunks()`` in row-major order.

    Lets a segment hold more than fits in memory (the disk tier's residual checkpoints): the
    writer never needs the whole tensor at once.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterator[bytes | bytearray | memoryview]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes sit inside a segment file."""

    offset: int  # from the start of the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_segment_stream(
    path: Path, tensors: Mapping[str, torch.Tensor | StreamedTensor]
) -> SegmentInfo:
    """Write a safetensors segment atomically without holding it in memory; returns its info.

    The header is built from shapes first, then each tensor's bytes are streamed in order
    and hashed on the way, so the checksum is of exactly the bytes written.
    """
    header: dict[str, Any] = {"__metadata__": SEGMENT_METADATA}
    offset = 0
    order = sorted(tensors)
    for name in order:
        tensor = tensors[name]
        dtype, shape = tensor.dtype, tuple(tensor.shape)
        code = _st_dtype(dtype)
        if code is None:
            raise TypeError(f"tensor {name!r}: dtype {dtype} cannot go in a segment")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    total = 8 + len(head) + offset

    def pieces() -> Iterator[bytes | bytearray | memoryview]:
        prefix = struct.pack("<Q", len(head)) + head
        digest.update(prefix)
        yield prefix
        for name in order:
            tensor = tensors[name]
            expected = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            written = 0
            parts = (
                tensor.chunks() if isinstance(tensor, StreamedTensor) else [_tensor_bytes(tensor)]
            )
            for part in parts:
                view = memoryview(part).cast("B")
                digest.update(view)
                written += len(view)
                yield view
            if written != expected:
                raise ValueError(f"tensor {name!r} produced {written} bytes, expected {expected}")

    write_atomic_stream(path, pieces())
    return SegmentInfo(file=path.name, sha256=digest.hexdigest(), nbytes=total)


def tensor_layout(path: Path, conv_id: str = "?") -> dict[str, TensorLocation]:
    """Byte locations of every tensor in a safetensors file, from its header alone.

    Checks the header as it reads it: a file that is not a well-formed segment raises
    SegmentCorruptedError, never a parser's own exception.
    """
    try:
        fd = open_regular(path, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) != 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", prefix)
            if n > size - 8:
                raise ValueError("header length runs past the end of the file")
            header = json.loads(f.read(n))
    except (OSError, ValueError, RecursionError) as e:
        raise _corrupted(path, conv_id, f"unreadable header: {_reason(e)}") from None
    if not isinstance(header, dict):
        raise _corrupted(path, conv_id, "header is not an object")
    base = 8 + n
    out = {}
    dtypes = _torch_dtypes()
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            shape = tuple(entry["shape"])
            dtype = dtypes[entry["dtype"]]
            valid = (
                all(type(x) is int and x >= 0 for x in (begin, end, *shape))
                and begin <= end <= size - base
                and end - begin == math.prod(shape) * dtype.itemsize
            )
        except (TypeError, ValueError, KeyError):
            valid = False
        if not valid:
            raise _corrupted(path, conv_id, f"header entry {name!r} is malformed")
        out[name] = TensorLocation(base + begin, end - begin, dtype, shape)
    return out


def content_digest(path: Path, conv_id: str = "?") -> str:
    """sha256 over each tensor's name, dtype, shape and bytes, in name order: equal for two
    files holding the same tensors, whichever writer laid them out (safetensors' own writer
    orders the header and the data its own way)."""
    digest = hashlib.sha256()
    layout = tensor_layout(path, conv_id)
    fd = open_regular(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        for name in sorted(layout):
            where = layout[name]
            digest.update(json.dumps([name, str(where.dtype), list(where.shape)]).encode())
            f.seek(where.offset)
            left = where.nbytes
            while left:
                block = f.read(min(left, 8 << 20))
                if not block:
                    raise _corrupted(path, conv_id, f"tensor {name!r} is cut short")
                digest.update(block)
                left -= len(block)
    return digest.hexdigest()


def write_segment(path: Path, data: bytes) -> None:
    """Write a segment atomically and durably (see atomic.write_atomic)."""
    write_atomic(path, data)


def _corrupted(path: Path, conv_id: str, why: str) -> SegmentCorruptedError:
    return SegmentCorruptedError(
        f"segment {path.name} of conversation {conv_id} is corrupted ({one_line(why)}); "
        f"run `kvchat repair {conv_id}` to rebuild it from the saved token ids (or `kvchat "
        f"export {conv_id}` to save the text, `kvchat delete {conv_id}` to remove it)"
    )


def _reason(e: BaseException) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)


def _stat_key(path: Path) -> tuple[str, int, int, int, int]:
    st = os.lstat(path)
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_size(path: Path, info: SegmentInfo, conv_id: str) -> int:
    """Cheap first check (an lstat): present, a regular file (not a link), and exactly as
    long as when it was written."""
    try:
        size = check_regular(path).st_size
    except FileNotFoundError:
        raise _corrupted(path, conv_id, "file missing") from None
    except UnsafePathError as e:
        raise _corrupted(path, conv_id, e.strerror) from None
    except OSError as e:
        raise _corrupted(path, conv_id, f"cannot stat: {e.strerror}") from None
    if size != info.nbytes:
        raise _corrupted(path, conv_id, f"{size} bytes, expected {info.nbytes}: truncated")
    return size


def _sha256_file(path: Path) -> str:
    """Streaming sha256 so verifying a large segment does not hold it all in memory."""
    h = hashlib.sha256()
    with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify(path: Path, info: SegmentInfo, conv_id: str) -> None:
    """Check size and sha256, at most once per process for an unchanged file."""
    check_size(path, info, conv_id)
    key = _stat_key(path)
    with _verified_lock:
        if _verified.get(key) == info.sha256:
            return
    try:
        digest = _sha256_file(path)
    except OSError as e:
        raise _corrupted(path, conv_id, f"unreadable: {e.strerror}") from None
    if digest != info.sha256:
        raise _corrupted(path, conv_id, "checksum mismatch")
    with _verified_lock:
        _verified[key] = digest


def remember(path: Path, sha256: str) -> None:
    """Record a segment this process has just written as verified (no need to re-hash it)."""
    with _verified_lock:
        _verified[_stat_key(path)] = sha256


def forget(path: Path) -> None:
    """Drop cached verifications of ``path``, or of everything under it if it is a folder
    (after deleting it, so the cache does not grow with dead entries)."""
    exact = str(path)
    prefix = exact.rstrip(os.sep) + os.sep
    with _verified_lock:
        for key in [k for k in _verified if k[0] == exact or k[0].startswith(prefix)]:
            del _verified[key]


def read_segment(path: Path, info: SegmentInfo, conv_id: str) -> dict[str, torch.Tensor]:
    """Every tensor of one segment, after checking that the bytes are the ones saved.

    Reads the file once into memory, hashes those bytes and parses those same bytes: nothing
    can change between the check and the use.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load

    check_size(path, info, conv_id)
    try:
        data = read_regular(path)
    except OSError as e:
        raise _corrupted(path, conv_id, f"unreadable: {e.strerror}") from None
    if hashlib.sha256(data).hexdigest() != info.sha256:
        raise _corrupted(path, conv_id, "checksum mismatch")
    try:
        tensors = st_load(data)
    except (SafetensorError, RuntimeError, ValueError, TypeError) as e:  # checksum ok: bad writer
        raise _corrupted(path, conv_id, f"not a safetensors file: {e}") from None
    with _verified_lock:
        _verified[_stat_key(path)] = info.sha256
    return tensors


def iter_segment(path: Path, info: SegmentInfo, conv_id: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, in the file's (sorted) name order."""
    from safetensors import SafetensorError, safe_open

    verify(path, info, conv_id)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = list(f.keys())
            for name in names:
                yield name, f.get_tensor(name)
    except SegmentCorruptedError:
        raise
    except (OSError, RuntimeError, ValueError, SafetensorError) as e:
        raise _corrupted(path, conv_id, f"unreadable: {e}") from None


def read_slice(
    path: Path, info: SegmentInfo, conv_id: str, name: str, start: int, stop: int
) -> torch.Tensor:
    """Rows [start, stop) along the first dimension of one tensor, reading only those rows.

    Raises KeyError for an unknown tensor name and IndexError for rows outside the tensor:
    those are caller bugs, not damaged files.
    """
    from safetensors import SafetensorError, safe_open

    verify(path, info, conv_id)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if name not in f.keys():
                raise KeyError(f"segment {path.name} has no tensor {name!r}")
            sl = f.get_slice(name)
            shape = sl.get_shape()
            if not shape:
                raise IndexError(f"tensor {name!r} in {path.name} is a scalar; it has no rows")
            if not 0 <= start <= stop <= shape[0]:
                raise IndexError(
                    f"rows [{start}:{stop}) outside tensor {name!r} with {shape[0]} rows"
                )
            return sl[start:stop]
    except (KeyError, IndexError):
        raise
    except (OSError, RuntimeError, ValueError, SafetensorError) as e:
        raise _corrupted(path, conv_id, f"unreadable: {e}") from None
