"""The disk tier: residual checkpoints that live in files, read back in bounded pieces.

When resident conversation state would pass ``--max-mem``, a layer's oldest checkpoints
move out of memory. Until the turn is saved they go to the session's spill files (one
append-only raw file per layer, under the data dir, deleted when the session closes); once a
turn is saved they are re-pointed at the conversation's own segment files (safetensors,
checksummed when the conversation is opened), and the spill files are emptied. Either way a
checkpoint on disk is a ``DiskRows``: a file, a byte offset, a shape and a dtype, read with
``preadv`` (a large read split over two threads) into a buffer the cache reuses, never
memory-mapped (a file truncated under a mapping would kill the process), so what is read
counts as scratch.
"""

from __future__ import annotations

import atexit
import bisect
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from kvchat.errors import StorageError

PARALLEL_READ_BYTES = 4 << 20  # reads at least this large are split over two threads
_READER: ThreadPoolExecutor | None = None


def _reader() -> ThreadPoolExecutor:
    global _READER
    if _READER is None:
        _READER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvchat-read")
    return _READER


class RowFile:
    """A file checkpoint rows are read from: a spill file (kept open, written to) or a
    saved segment (opened for each read, so a long conversation holds no descriptor per
    turn).

    A spill file reuses the space of rows that died (a sliding window moved past them, they
    were read back into memory, or a save took them): :meth:`write` puts new rows in the
    first gap between live ranges that holds them, so the file stays about as large as the
    rows it holds, not as everything ever spilled."""

    def __init__(self, path: Path, writable: bool = False) -> None:
        self.path = Path(path)
        self.writable = writable
        self.live: list[tuple[int, int]] = []  # [start, end) byte ranges still read, sorted
        self.fd = -1
        if writable:
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
            self.fd = os.open(self.path, flags, 0o600)
            self.size = os.fstat(self.fd).st_size
        else:
            self.size = os.stat(self.path).st_size

    def read_into(self, buffer: memoryview, offset: int) -> None:
        try:
            fd = self.fd if self.writable else os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise StorageError(f"cannot read {self.path} ({e.strerror}); {self._fix()}") from None
        try:
            if len(buffer) < PARALLEL_READ_BYTES:
                self._read_span(fd, buffer, offset)
                return
            # One preadv copies from the page cache on one core; a second thread copying
            # the other half roughly halves the time of a large read-back.
            half = len(buffer) // 2
            other = _reader().submit(self._read_span, fd, buffer[half:], offset + half)
            try:
                self._read_span(fd, buffer[:half], offset)
            finally:
                other.result()
        finally:
            if not self.writable:
                os.close(fd)

    def _read_span(self, fd: int, buffer: memoryview, offset: int) -> None:
        done = 0
        while done < len(buffer):
            try:
                n = os.preadv(fd, [buffer[done:]], offset + done)
            except OSError as e:
                raise StorageError(f"reading {self.path} failed ({e.strerror})") from None
            if n <= 0:
                raise StorageError(
                    f"{self.path} ended early (wanted {len(buffer)} bytes at {offset}); "
                    f"{self._fix()}"
                )
            done += n

    def _fix(self) -> str:
        if self.writable:
            return "the session's spill file was changed under it; start the conversation again"
        return "the conversation's files are damaged: export it, or delete it"

    def write(self, data: memoryview) -> int:
        """Write ``data`` into the first gap that holds it (else at the end); returns its
        offset. OSError (disk full) propagates, with nothing marked live."""
        n = len(data)
        offset = 0
        for start, end in self.live:
            if start - offset >= n:
                break
            offset = end
        done = 0
        while done < n:
            done += os.pwrite(self.fd, data[done:], offset + done)
        bisect.insort(self.live, (offset, offset + n))
        self.size = max(self.size, offset + n)
        return offset

    def release(self, offset: int, nbytes: int) -> None:
        """Rows at [offset, offset + nbytes) will not be read again: their space is free."""
        if not self.writable or nbytes <= 0:
            return
        lo, hi = offset, offset + nbytes
        kept: list[tuple[int, int]] = []
        for start, end in self.live:
            if end <= lo or start >= hi:
                kept.append((start, end))
                continue
            if start < lo:
                kept.append((start, lo))
            if end > hi:
                kept.append((hi, end))
        self.live = kept
        if not kept:
            self.truncate()
        elif kept[-1][1] < self.size:
            os.ftruncate(self.fd, kept[-1][1])
            self.size = kept[-1][1]

    def truncate(self) -> None:
        os.ftruncate(self.fd, 0)
        self.size = 0
        self.live = []

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(frozen=True)
class DiskRows:
    """Checkpoint rows that sit in a file: ``shape`` ([1, M, d]) elements of ``dtype``."""

    file: RowFile
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @cached_property  # read for every piece of every cold read
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def tensor_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def read_rows(
    parts: list[DiskRows], device: torch.device | str, into: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Load several runs of rows; runs adjacent in one file are read with a single call.

    ``into``: a flat uint8 CPU buffer at least as large as all the parts, reused from call
    to call (the decode loop's scratch), so reading does not fault in fresh pages each step;
    the rows returned are then views of it, valid until the buffer's next use."""
    out: list[torch.Tensor] = []
    used = 0
    i = 0
    while i < len(parts):
        j = i
        while (
            j + 1 < len(parts)
            and parts[j + 1].file is parts[i].file
            and parts[j + 1].offset == parts[j].offset + parts[j].nbytes
            and parts[j + 1].dtype == parts[i].dtype
        ):
            j += 1
        run = parts[i : j + 1]
        total = sum(p.nbytes for p in run)
        if into is not None:
            buffer = into[used : used + total]
            used += total
        else:
            buffer = torch.empty(total, dtype=torch.uint8)
        run[0].file.read_into(tensor_view(buffer), run[0].offset)
        at = 0
        for part in run:
            rows = buffer[at : at + part.nbytes].view(part.dtype).reshape(part.shape)
            out.append(rows.to(device) if str(device) != "cpu" else rows)
            at += part.nbytes
        i = j + 1
    return out


class SpillArea:
    """The session's spill files: one file per layer in a private directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path: Path | None = None
        self.files: dict[int, RowFile] = {}

    def _dir(self) -> Path:
        if self.path is None:
            from kvchat.storage.spill import create_spill_folder

            self.path = create_spill_folder(self.root)
            # Closed sessions remove it; this covers an exit that skips the close (the UI
            # quitting mid-reply). A crash leaves it for the next session's sweep.
            atexit.register(self.close)
        return self.path

    def write(self, layer: int, rows: torch.Tensor) -> DiskRows:
        """Move ``rows`` ([1, M, d]) to layer ``layer``'s spill file."""
        file = self.files.get(layer)
        if file is None:
            try:
                file = self.files[layer] = RowFile(self._dir() / f"L{layer}.bin", writable=True)
            except OSError as e:
                raise StorageError(
                    f"cannot create spill files under {self.root} ({e.strerror}); free space or "
                    "choose another --data-dir"
                ) from None
        cpu = rows.detach().to("cpu").contiguous()
        try:
            offset = file.write(tensor_view(cpu))
        except OSError as e:
            raise StorageError(
                f"moving checkpoints to disk failed ({e.strerror}) in {file.path.parent}; "
                "free disk space or raise --max-mem"
            ) from None
        return DiskRows(file, offset, tuple(cpu.shape), cpu.dtype)

    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def empty(self) -> None:
        """Every spilled row now lives in a saved segment: the spill files can go empty."""
        for file in self.files.values():
            file.truncate()

    def close(self) -> None:
        for file in self.files.values():
            file.close()
        self.files.clear()
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None
