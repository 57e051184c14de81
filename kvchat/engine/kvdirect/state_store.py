"""One layer's cold rows, wherever they live: the boundary between the cache and the tiers.

A *piece* is a run of consecutive positions stored in one form:

* ``residual``: the residual ``h_l`` that entered the layer, ``[1, M, hidden]``, kept with
  the row count of the forward call that produced it (replaying that shape is what makes
  recompute bit-identical, see cache.py);
* ``kv``: the layer's K and V themselves, packed token-major as ``[1, M, 2 * heads * dim]``
  (all K heads of a token, then all V heads), so any run of positions is one contiguous
  byte range in memory, in a spill file and in a saved segment.

Each piece sits in one of three places: resident (a tensor), a spill file of this session,
or a saved segment of the conversation (``DiskRows``). Pieces on disk carry an xxh3 digest
of their bytes, checked on every read, so a changed spill or segment file is named instead
of silently feeding other rows to attention.

``RowStore`` keeps the pieces of one layer in position order with running byte counters,
so nothing walks every piece per token to answer "how much is resident". Resident pieces
are always a suffix of the list (pieces leave memory oldest first), which makes "move the
oldest resident rows out" O(pieces moved).

The interface, in the spirit of mlx-lm's cache protocol: ``append``, ``pieces_in`` /
``load`` (read rows of [begin, end)), ``move_out``, ``bind_saved`` (rebind rows to a saved
segment), ``drop_before`` (sliding windows), and ``state`` / ``from_state`` for persistence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import xxhash

from kvchat.engine.kvdirect.disk_tier import DiskRows, SpillArea, read_rows, tensor_view
from kvchat.errors import StorageError

MAX_PIECE_ROWS = 256  # K/V rows spilled into one piece: bounds one read (and its check)


def pack_kv(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[1, H, M, d] K and V -> token-major rows [1, M, 2 * H * d] (all K heads, then V)."""
    m = keys.shape[-2]
    k = keys.transpose(1, 2).reshape(1, m, -1)
    v = values.transpose(1, 2).reshape(1, m, -1)
    return torch.cat([k, v], dim=-1)


def unpack_kv(rows: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``pack_kv``: views, no copy."""
    m = rows.shape[1]
    both = rows.view(1, m, 2, heads, dim)
    return both[:, :, 0].transpose(1, 2), both[:, :, 1].transpose(1, 2)


FORMS = ("residual", "kv")


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def digest_of(rows: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(tensor_view(rows.detach().to("cpu").contiguous()))


@dataclass
class Piece:
    """Consecutive positions [start, start + rows) of one layer, in one form and place."""

    start: int
    form: str
    resident: torch.Tensor | None = None  # [1, M, W] while in memory
    disk: DiskRows | None = None  # where the rows are once out of memory
    saved: DiskRows | None = None  # the same rows in a saved segment, once saved
    digest: int | None = None  # xxh3 of the bytes on disk (None: not known yet)
    calls: list[int] | None = None  # residual form: row count of each original call
    # While the piece may grow (its digest is kept up to date as rows are appended).
    hasher: xxhash.xxh3_64 | None = field(default=None, repr=False, compare=False)

    @property
    def rows(self) -> int:
        held = self.resident if self.resident is not None else self.disk
        return held.shape[1]

    @property
    def end(self) -> int:
        return self.start + self.rows

    @property
    def width(self) -> int:
        held = self.resident if self.resident is not None else self.disk
        return held.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        held = self.resident if self.resident is not None else self.disk
        return held.dtype

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype.itemsize

    @property
    def resident_bytes(self) -> int:
        return nbytes(self.resident)

    @property
    def in_spill(self) -> bool:
        return self.resident is None and self.disk is not None and self.disk is not self.saved


@dataclass
class PieceState:
    """What ``RowStore.state`` reports of one piece: enough to find it in a segment."""

    start: int
    rows: int
    form: str
    calls: list[int] | None


def split_piece(piece: Piece, at: int) -> tuple[Piece, Piece]:
    """``piece`` cut at position ``at`` (start < at < end). Residual pieces are cut only at
    call boundaries by the callers that need exactness; kv pieces anywhere."""
    r = at - piece.start
    calls_a = calls_b = None
    if piece.calls is not None:
        acc, i = 0, 0
        while i < len(piece.calls) and acc + piece.calls[i] <= r:
            acc += piece.calls[i]
            i += 1
        if acc != r:
            raise ValueError("a residual piece is cut only between its calls")
        calls_a, calls_b = piece.calls[:i], piece.calls[i:]

    def part(rows_from: int, rows_to: int, calls: list[int] | None) -> Piece:
        resident = None if piece.resident is None else piece.resident[:, rows_from:rows_to]
        disk = None if piece.disk is None else sub_rows(piece.disk, rows_from, rows_to)
        saved = None if piece.saved is None else sub_rows(piece.saved, rows_from, rows_to)
        return Piece(piece.start + rows_from, piece.form, resident, disk, saved, None, calls)

    return part(0, r, calls_a), part(r, piece.rows, calls_b)


def sub_rows(where: DiskRows, r0: int, r1: int) -> DiskRows:
    row_bytes = where.nbytes // where.shape[1]
    return DiskRows(
        where.file, where.offset + r0 * row_bytes, (1, r1 - r0, where.shape[-1]), where.dtype
    )


class _ReadRun:
    """Parts of pieces on disk that lie back to back in the window's buffer, read together
    through ``read_rows`` (which reads parts adjacent in one file with one call: most of a
    window's parts are, rows spilled in order sitting in order), so a long run is one read
    split over two threads instead of one small read per part. Each piece's digest still
    covers its parts in order and is checked with its last part."""

    def __init__(self, flat: torch.Tensor, check: Callable[[Piece, int], None]) -> None:
        self.flat = flat
        self.check = check
        self.parts: list[tuple[DiskRows, int, Piece, xxhash.xxh3_64, bool]] = []

    def add(
        self, part: DiskRows, at: int, piece: Piece, hasher: xxhash.xxh3_64, last: bool
    ) -> None:
        if self.parts:
            previous, previous_at = self.parts[-1][:2]
            if at != previous_at + previous.nbytes:
                self.finish()
        self.parts.append((part, at, piece, hasher, last))

    def finish(self) -> None:
        """Read the run and check the digests of the pieces it completes."""
        if not self.parts:
            return
        start = self.parts[0][1]
        rows = read_rows([p[0] for p in self.parts], "cpu", into=self.flat[start:])
        for (_, _, piece, hasher, last), read in zip(self.parts, rows):
            hasher.update(tensor_view(read))
            if last:
                self.check(piece, hasher.intdigest())
        self.parts.clear()


def _release_spill(piece: Piece) -> None:
    """``piece`` stops reading its spill rows (dropped, back in memory, or saved)."""
    if piece.disk is not None and piece.disk is not piece.saved:
        piece.disk.file.release(piece.disk.offset, piece.disk.nbytes)


@dataclass
class RowStore:
    """The pieces of one layer, in position order, with running byte counters."""

    layer_idx: int
    pieces: list[Piece] = field(default_factory=list)
    resident_bytes: int = 0
    disk_bytes: int = 0  # bytes of pieces that are not resident (spill or segment)
    spill_bytes: int = 0  # of those, bytes that sit in a spill file
    max_piece_rows: int = 256  # spilled K/V rows merged into one piece at most
    _first_resident: int = 0  # pieces[:_first_resident] are on disk

    # -- growing and shrinking -----------------------------------------------------------
    def append(self, piece: Piece) -> None:
        if self.pieces and piece.start != self.pieces[-1].end:
            raise ValueError(
                f"layer {self.layer_idx}: piece at {piece.start} does not follow "
                f"{self.pieces[-1].end}"
            )
        self.pieces.append(piece)
        self._count(piece, +1)
        self._advance()

    def _advance(self) -> None:
        while (
            self._first_resident < len(self.pieces)
            and self.pieces[self._first_resident].resident is None
        ):
            self._first_resident += 1

    def _extends(self, last: Piece, piece: Piece) -> bool:
        """Whether ``piece`` was spilled right after ``last`` in the same file, and both
        fit in one bounded read."""
        return (
            last.form == piece.form == "kv"
            and last.in_spill
            and piece.in_spill
            and last.disk.file is piece.disk.file
            and last.disk.offset + last.disk.nbytes == piece.disk.offset
            and last.disk.shape[-1] == piece.disk.shape[-1]
            and last.rows + piece.rows <= self.max_piece_rows
            and last.hasher is not None
        )

    def _extend(self, last: Piece, piece: Piece, data: memoryview) -> None:
        """One piece, one read, one digest for rows spilled one after another."""
        self._count(last, -1)
        d = last.disk
        shape = (1, d.shape[1] + piece.disk.shape[1], d.shape[-1])
        last.disk = DiskRows(d.file, d.offset, shape, d.dtype)
        last.hasher.update(data)
        last.digest = last.hasher.intdigest()
        self._count(last, +1)

    def _count(self, piece: Piece, sign: int) -> None:
        if piece.resident is not None:
            self.resident_bytes += sign * piece.resident_bytes
            return
        size = piece.disk.nbytes
        self.disk_bytes += sign * size
        if piece.in_spill:
            self.spill_bytes += sign * size

    def drop_before(self, position: int) -> None:
        """Forget pieces no query can see again (every row before ``position``)."""
        n = 0
        while n < len(self.pieces) and self.pieces[n].end <= position:
            self._count(self.pieces[n], -1)
            _release_spill(self.pieces[n])
            n += 1
        if n:
            del self.pieces[:n]
            self._first_resident = max(0, self._first_resident - n)

    def clear(self) -> None:
        self.pieces.clear()
        self.resident_bytes = self.disk_bytes = self.spill_bytes = 0
        self._first_resident = 0

    # -- reading -------------------------------------------------------------------------
    @property
    def start(self) -> int | None:
        return self.pieces[0].start if self.pieces else None

    @property
    def end(self) -> int | None:
        return self.pieces[-1].end if self.pieces else None

    def pieces_in(self, begin: int, end: int) -> list[Piece]:
        return [p for p in self.pieces if p.end > begin and p.start < end]

    def call_start(self, position: int) -> int:
        """The first position of the forward call whose residual rows hold ``position``
        (where the store can be cut without splitting a call), else ``position``."""
        for p in self.pieces_in(position, position + 1):
            if p.calls is not None:
                at = p.start
                for rows in p.calls:
                    if at + rows > position:
                        return at
                    at += rows
        return position

    def load(
        self,
        pieces: list[Piece],
        device: torch.device | str,
        scratch: Callable[[int], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """The rows of ``pieces`` (resident as they are; those on disk read and checked).
        ``scratch(nbytes)``: a reusable flat uint8 buffer to read into (see read_rows)."""
        on_disk = [p for p in pieces if p.resident is None]
        into = None
        if scratch is not None and on_disk:
            into = scratch(sum(p.disk.nbytes for p in on_disk))
        loaded = iter(read_rows([p.disk for p in on_disk], device, into) if on_disk else [])
        out = []
        for p in pieces:
            if p.resident is not None:
                out.append(p.resident)
                continue
            rows = next(loaded)
            self._check(p, digest_of(rows))
            out.append(rows)
        return out

    def read_into(self, pieces: list[Piece], dest: torch.Tensor) -> None:
        """Rows of ``pieces`` (consecutive K/V pieces of one width and dtype) into ``dest``,
        a flat uint8 CPU tensor of exactly their bytes, in position order: those on disk
        read (``read_rows``: one call per run adjacent in a file) and checked against their
        digests, resident ones (a suffix, see the class) copied behind them."""
        first_resident = next(
            (i for i, p in enumerate(pieces) if p.resident is not None), len(pieces)
        )
        on_disk = pieces[:first_resident]
        size = sum(p.disk.nbytes for p in on_disk)
        if on_disk:
            for p, rows in zip(on_disk, read_rows([p.disk for p in on_disk], "cpu", dest[:size])):
                self._check(p, digest_of(rows))
        at = size
        for p in pieces[first_resident:]:
            if p.resident is None:
                raise ValueError(f"layer {self.layer_idx}: a piece on disk after resident ones")
            n = p.resident_bytes
            dest[at : at + n].view(p.dtype).view(p.resident.shape).copy_(p.resident.detach())
            at += n
        if at != dest.numel():
            raise ValueError(f"layer {self.layer_idx}: read {at} of {dest.numel()} bytes")

    def load_in_parts(
        self, piece: Piece, device: torch.device | str, cuts: list[int]
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """``piece``'s rows in parts split at the row offsets ``cuts``, as (first row, rows):
        bounded scratch for a piece longer than a streamed chunk. The digest runs over the
        parts in order and is checked with the last one, which raises inside the forward
        call that used them, so nothing computed from changed rows is ever returned."""
        bounds = [0, *[c for c in cuts if 0 < c < piece.rows], piece.rows]
        if piece.resident is not None:
            for r0, r1 in zip(bounds, bounds[1:]):
                yield r0, piece.resident[:, r0:r1]
            return
        hasher = xxhash.xxh3_64()
        for r0, r1 in zip(bounds, bounds[1:]):
            (rows,) = read_rows([sub_rows(piece.disk, r0, r1)], device)
            hasher.update(tensor_view(rows.detach().to("cpu").contiguous()))
            if r1 == piece.rows:
                self._check(piece, hasher.intdigest())
            yield r0, rows

    def load_windows(
        self,
        pieces: list[Piece],
        begin: int,
        end: int,
        rows_per_window: int,
        buffer: Callable[[int], torch.Tensor],
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Rows of positions [begin, end) in windows of ``rows_per_window`` positions counted
        from ``begin``, as (first position, token-major rows [1, n, W]).

        Each window is assembled in ``buffer(nbytes)`` (a flat uint8 CPU buffer reused for
        every window), the parts of a window that straddles pieces read back to back, so a
        window is one view and never a concatenation. Every piece on disk is read whole
        (rows before ``begin`` too, in window-sized parts) so its digest is checked with its
        last part, inside the forward call that used it. A window's view is valid until the
        next one is asked for. Pieces hold K/V rows of one width and dtype."""
        if not pieces:
            return
        width, dtype = pieces[0].width, pieces[0].dtype
        row_bytes = width * dtype.itemsize
        flat = buffer(rows_per_window * row_bytes)
        filled = 0  # rows of the current window in ``flat``
        window_first = begin
        reads = _ReadRun(flat, self._check)
        for piece in pieces:
            if piece.width != width or piece.dtype != dtype:
                raise ValueError(f"layer {self.layer_idx}: pieces of one window differ in layout")
            hasher = xxhash.xxh3_64() if piece.resident is None else None
            bounds = sorted(
                {piece.start, piece.end}
                | {
                    b
                    for b in [*range(begin, end, rows_per_window), end]
                    if piece.start < b < piece.end
                }
                | {
                    b
                    for b in range(begin - rows_per_window, piece.start, -rows_per_window)
                    if piece.start < b < piece.end
                }
            )
            for a, b in zip(bounds, bounds[1:]):
                visible = begin <= a < end
                at = filled * row_bytes if visible else 0
                dest = flat[at : at + (b - a) * row_bytes]
                if piece.resident is not None:
                    if visible:
                        rows = piece.resident[:, a - piece.start : b - piece.start]
                        dest.view(dtype).view(1, b - a, width).copy_(rows)
                else:
                    part = sub_rows(piece.disk, a - piece.start, b - piece.start)
                    reads.add(part, at, piece, hasher, b == piece.end)
                if not visible:
                    continue
                filled += b - a
                if filled == rows_per_window or b == end:
                    reads.finish()
                    yield (
                        window_first,
                        flat[: filled * row_bytes].view(dtype).view(1, filled, width),
                    )
                    window_first += filled
                    filled = 0
        reads.finish()
        if filled:
            yield window_first, flat[: filled * row_bytes].view(dtype).view(1, filled, width)

    def _check(self, p: Piece, check: int) -> None:
        if p.digest is None:
            p.digest = check  # first read since the segment was verified whole
        elif check != p.digest:
            raise StorageError(
                f"{p.disk.file.path} changed under this session (checksum mismatch in "
                f"layer {self.layer_idx}'s rows {p.start}-{p.end}); the turns saved before "
                "stay usable: resume the conversation again"
            )

    def read_bytes(self, pieces: list[Piece]) -> int:
        return sum(p.disk.nbytes for p in pieces if p.resident is None)

    # -- moving between tiers -------------------------------------------------------------
    def move_out(self, excess: int, spill: SpillArea) -> int:
        """Move the oldest resident pieces out until ``excess`` bytes are freed. Rows already
        in a saved segment are just re-pointed; others are written to ``spill`` in one run.
        Returns the bytes written. StorageError (disk full) leaves everything resident."""
        moving, freed = [], 0
        for piece in self.pieces[self._first_resident :]:
            if freed >= excess:
                break
            if piece.resident is None:
                continue
            moving.append(piece)
            freed += piece.resident_bytes
        if not moving:
            return 0
        unsaved = [p for p in moving if p.saved is None]
        written = 0
        if unsaved:
            by_width: dict[int, list[Piece]] = {}
            for p in unsaved:
                by_width.setdefault(p.width, []).append(p)
            plans = []
            for group in by_width.values():
                rows = torch.cat([p.resident for p in group], dim=1)
                plans.append((group, spill.write(self.layer_idx, rows)))
            for group, where in plans:
                offset = where.offset
                for p in group:
                    p.disk = DiskRows(where.file, offset, tuple(p.resident.shape), where.dtype)
                    p.digest = digest_of(p.resident)
                    offset += p.resident_bytes
                    written += p.resident_bytes
        for p in moving:
            self._count(p, -1)
            if p.saved is not None:
                p.disk = p.saved
            p.resident = None
            self._count(p, +1)
        self._advance()
        return written

    def write_out(self, piece: Piece, spill: SpillArea) -> None:
        """Append ``piece`` (resident rows leaving the hot window) on disk: into its saved
        segment when it is one, else the spill file. StorageError propagates, with
        ``piece`` and the store unchanged."""
        rows = piece.resident
        if piece.saved is not None:
            piece.disk, piece.digest, piece.resident = piece.saved, digest_of(rows), None
            self.append(piece)
            return
        data = tensor_view(rows.detach().to("cpu").contiguous())
        piece.disk = spill.write(self.layer_idx, rows)
        piece.resident = None
        last = self.pieces[-1] if self.pieces else None
        if last is not None and self._extends(last, piece):
            self._extend(last, piece, data)
            return
        piece.hasher = xxhash.xxh3_64(data)
        piece.digest = piece.hasher.intdigest()
        self.append(piece)

    def load_resident(self, device: torch.device | str) -> None:
        """Bring every piece on disk back into memory."""
        on_disk = self.pieces[: self._first_resident]
        for p, rows in zip(on_disk, self.load(on_disk, device)):
            self._count(p, -1)
            p.resident = rows.clone() if rows.device.type == "cpu" else rows
            if p.saved is None:
                _release_spill(p)
                p.disk = None
            self._count(p, +1)
        self._first_resident = 0

    def take(self, begin: int) -> list[Piece]:
        """Remove and return the pieces from position ``begin`` on (cut where needed)."""
        out: list[Piece] = []
        while self.pieces and self.pieces[-1].end > begin:
            p = self.pieces.pop()
            self._count(p, -1)
            if p.start < begin:
                head, p = split_piece(p, begin)
                self.pieces.append(head)
                self._count(head, +1)
                out.append(p)
                break
            out.append(p)
        self._first_resident = min(self._first_resident, len(self.pieces))
        self._advance()
        return out[::-1]

    # -- persistence ---------------------------------------------------------------------
    def state(self, since: int) -> list[tuple[PieceState, Piece]]:
        """The pieces at positions >= ``since`` (what a save must write), oldest first."""
        return [
            (PieceState(p.start, p.rows, p.form, p.calls), p)
            for p in self.pieces
            if p.start >= since
        ]

    def stream(self, pieces: list[Piece], chunk_rows: int) -> Iterator[memoryview]:
        """The bytes of ``pieces`` in order, a bounded run at a time (never gathered)."""
        i = 0
        while i < len(pieces):
            j, rows = i + 1, pieces[i].rows
            while j < len(pieces) and rows + pieces[j].rows <= chunk_rows:
                rows += pieces[j].rows
                j += 1
            for rows_tensor in self.load(pieces[i:j], "cpu"):
                yield tensor_view(rows_tensor.detach().to("cpu").contiguous())
            i = j

    def bind_saved(self, pieces: list[Piece], where: list[DiskRows]) -> None:
        """``pieces`` were saved at ``where``: read them from there from now on."""
        for p, rows in zip(pieces, where):
            self._count(p, -1)
            p.saved = rows
            p.hasher = None  # saved rows never grow
            if p.resident is None:
                _release_spill(p)
                p.disk = rows
            self._count(p, +1)

    def from_state(self, entries: list[tuple[PieceState, DiskRows]]) -> None:
        """Rebuild from a saved segment's pieces (rows stay there until read)."""
        for state, where in entries:
            self.append(Piece(state.start, state.form, None, where, where, None, state.calls))
