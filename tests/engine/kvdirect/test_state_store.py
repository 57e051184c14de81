"""The per-layer state store: counters, tiers, checksums, and the faults around them."""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.chat import persist
from kvchat.engine.chat.conversation import open_session
from kvchat.engine.chat.session import ChatSession
from kvchat.engine.chat.settings import CacheSettings, SamplingSettings
from kvchat.engine.kvdirect.disk_tier import SpillArea
from kvchat.engine.kvdirect.state_store import Piece, RowStore
from kvchat.errors import StorageError


def rows(n: int, width: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, n, width, generator=torch.Generator().manual_seed(seed))


def test_counters_follow_the_pieces_through_the_tiers(tmp_path):
    store = RowStore(0)
    spill = SpillArea(tmp_path)
    a, b, c = rows(4, seed=1), rows(3, seed=2), rows(5, seed=3)
    for start, r in ((0, a), (4, b), (7, c)):
        store.append(Piece(start, "kv", r.clone()))
    assert store.resident_bytes == (4 + 3 + 5) * 6 * 4 and store.disk_bytes == 0
    written = store.move_out(1, spill)  # the oldest piece is enough
    assert written == 4 * 6 * 4
    assert store.resident_bytes == 8 * 6 * 4 and store.disk_bytes == store.spill_bytes == 96
    store.move_out(10**6, spill)
    assert store.resident_bytes == 0 and store.disk_bytes == 12 * 6 * 4
    loaded = store.load(store.pieces_in(0, 12), "cpu")
    assert all(torch.equal(x, y) for x, y in zip(loaded, (a, b, c)))
    store.drop_before(7)
    assert [p.start for p in store.pieces] == [7] and store.disk_bytes == 5 * 6 * 4
    spill.close()


def test_rows_written_out_one_by_one_become_one_bounded_piece(tmp_path):
    store = RowStore(0, max_piece_rows=4)
    spill = SpillArea(tmp_path)
    all_rows = rows(10)
    for i in range(10):
        store.write_out(Piece(i, "kv", all_rows[:, i : i + 1].clone()), spill)
    assert [p.rows for p in store.pieces] == [4, 4, 2]  # merged, never past the bound
    got = torch.cat(store.load(store.pieces, "cpu"), dim=1)
    assert torch.equal(got, all_rows)
    spill.close()


def test_a_changed_spill_file_is_named_not_read(tmp_path):
    store = RowStore(3)
    spill = SpillArea(tmp_path)
    store.write_out(Piece(0, "kv", rows(8)), spill)
    path = store.pieces[0].disk.file.path
    with open(path, "r+b") as fh:
        fh.seek(5)
        byte = fh.read(1)
        fh.seek(5)
        fh.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(StorageError, match=str(path)) as err:
        store.load(store.pieces, "cpu")
    assert "\n" not in str(err.value) and "checksum" in str(err.value)
    spill.close()


def mixed_store(tmp_path, sizes=(5, 3, 7, 4)) -> tuple[RowStore, SpillArea, torch.Tensor]:
    """Pieces of ``sizes`` rows, all but the last moved to a spill file."""
    store = RowStore(0)
    spill = SpillArea(tmp_path)
    everything = rows(sum(sizes), seed=7)
    at = 0
    for n in sizes:
        store.append(Piece(at, "kv", everything[:, at : at + n].clone()))
        at += n
    store.move_out(sum(sizes[:-1]) * 6 * 4, spill)
    assert [p.resident is None for p in store.pieces] == [True] * (len(sizes) - 1) + [False]
    return store, spill, everything


def test_rows_read_in_place_equal_the_rows_written(tmp_path):
    store, spill, everything = mixed_store(tmp_path)
    dest = torch.empty(everything.numel() * 4, dtype=torch.uint8)
    store.read_into(store.pieces, dest)
    assert torch.equal(dest.view(torch.float32).view(everything.shape), everything)
    spill.close()


def test_rows_read_in_place_are_checked(tmp_path):
    store, spill, everything = mixed_store(tmp_path)
    path = store.pieces[0].disk.file.path
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01  # inside the first piece
    path.write_bytes(bytes(data))
    dest = torch.empty(everything.numel() * 4, dtype=torch.uint8)
    with pytest.raises(StorageError, match="checksum"):
        store.read_into(store.pieces, dest)
    spill.close()


@pytest.mark.parametrize("begin", [0, 2, 5, 9])
@pytest.mark.parametrize("window", [1, 4, 6, 19])
def test_windows_are_counted_from_begin_whatever_the_pieces(tmp_path, begin, window):
    store, spill, everything = mixed_store(tmp_path)
    end = everything.shape[1]
    buffer = {}

    def scratch(n: int) -> torch.Tensor:
        buffer.setdefault(n, torch.empty(n, dtype=torch.uint8))
        return buffer[n]

    firsts, got = [], []
    for first, part in store.load_windows(store.pieces_in(begin, end), begin, end, window, scratch):
        firsts.append(first)
        got.append(part.clone())  # a window's view lives until the next one
    assert firsts == list(range(begin, end, window))
    assert all(g.shape[1] == min(window, end - f) for f, g in zip(firsts, got))
    assert torch.equal(torch.cat(got, dim=1), everything[:, begin:end])
    assert len(buffer) == 1  # one buffer, reused for every window
    spill.close()


def test_a_changed_row_before_the_first_window_is_still_caught(tmp_path):
    store, spill, everything = mixed_store(tmp_path)
    path = store.pieces[0].disk.file.path
    data = bytearray(path.read_bytes())
    data[4] ^= 0x01  # row 0: before the window's begin, in the piece it starts in
    path.write_bytes(bytes(data))
    with pytest.raises(StorageError, match="checksum"):
        list(
            store.load_windows(
                store.pieces_in(2, 19), 2, 19, 4, lambda n: torch.empty(n, dtype=torch.uint8)
            )
        )
    spill.close()


def test_pieces_back_to_back_on_disk_are_read_in_one_call_and_each_still_checked(
    tmp_path, monkeypatch
):
    """Pieces spilled one after another (kept apart here by a small piece size) lie back to
    back in the file: a window that holds them is one read, and a byte changed in any of
    them is still caught."""
    from kvchat.engine.kvdirect import disk_tier

    store = RowStore(0)
    store.max_piece_rows = 4
    spill = SpillArea(tmp_path)
    everything = rows(20, seed=3)
    for at in range(0, 20, 4):
        store.append(Piece(at, "kv", everything[:, at : at + 4].clone()))
        store.move_out(4 * 6 * 4, spill)  # each piece out on its own, as decode spills them
    assert len(store.pieces) == 5 and all(p.resident is None for p in store.pieces)
    calls = []
    original = disk_tier.RowFile.read_into

    def counted(self, buffer, offset):
        calls.append(len(buffer))
        return original(self, buffer, offset)

    monkeypatch.setattr(disk_tier.RowFile, "read_into", counted)

    def windows(begin: int) -> list[torch.Tensor]:
        scratch = torch.empty(20 * 6 * 4, dtype=torch.uint8)
        out = store.load_windows(store.pieces_in(begin, 20), begin, 20, 20, lambda n: scratch)
        return [part.clone() for _, part in out]

    (whole,) = windows(0)
    assert torch.equal(whole, everything) and len(calls) == 1
    path = store.pieces[3].disk.file.path
    data = bytearray(path.read_bytes())
    data[store.pieces[3].disk.offset + 5] ^= 0x01  # inside the fourth piece of the run
    path.write_bytes(bytes(data))
    with pytest.raises(StorageError, match="checksum mismatch in layer 0's rows 12-16"):
        windows(0)
    spill.close()


GREEDY = SamplingSettings(max_new_tokens=12)
PROMPTS = ("Name three rivers.", "Which is longest?", "And the shortest?", "Thanks. Why?")
TIGHT = CacheSettings(max_mem=10**6, prefill_chunk=16)  # K/V spill from the first turn


@pytest.mark.slow
def test_a_failed_repointing_never_lets_a_later_save_truncate_rows_in_use(
    smollm2_loaded, tmp_path, monkeypatch
):
    """The bug: when note_saved failed, spilled rows kept pointing into spill files that the
    next successful save emptied; later reads returned other rows, silently."""
    reference = ChatSession(smollm2_loaded, cache=CacheSettings(kind="standard", prefill_chunk=16))
    expected = [reference.send(p, GREEDY).tokens for p in PROMPTS]
    session = open_session(smollm2_loaded, data_dir=tmp_path, cache=TIGHT)
    got = [session.send(PROMPTS[0], GREEDY).tokens]
    real = persist.note_saved

    def failing(*args, **kwargs):
        raise OSError("injected")

    monkeypatch.setattr(persist, "note_saved", failing)
    second = session.send(PROMPTS[1], GREEDY)
    got.append(second.tokens)
    assert second.error and "spill files" in second.error
    assert session.cache.spill_bytes_live() > 0
    monkeypatch.setattr(persist, "note_saved", real)
    got.append(session.send(PROMPTS[2], GREEDY).tokens)  # a successful save
    assert session.cache.disk_bytes() > 0  # the rows still in use were not emptied
    got.append(session.send(PROMPTS[3], GREEDY).tokens)
    session.close()
    assert got == expected


@pytest.mark.slow
def test_a_spill_file_changed_mid_conversation_is_named_and_the_saved_turns_resume(
    smollm2_loaded, tmp_path
):
    reference = ChatSession(smollm2_loaded, cache=CacheSettings(kind="standard", prefill_chunk=16))
    expected = [reference.send(p, GREEDY).tokens for p in PROMPTS[:2]]
    session = open_session(smollm2_loaded, data_dir=tmp_path, cache=TIGHT, save=False)
    session.send(PROMPTS[0], GREEDY)
    spilled = next(p for layer in session.cache.layers for p in layer.store.pieces if p.in_spill)
    with open(spilled.disk.file.path, "r+b") as fh:
        fh.seek(spilled.disk.offset)
        fh.write(b"\xff" * 8)
    with pytest.raises(StorageError, match="checksum"):
        session.send(PROMPTS[1], GREEDY)
    session.close()
    # A conversation that was saved turn by turn resumes from its segments.
    saved = open_session(smollm2_loaded, data_dir=tmp_path, cache=TIGHT)
    assert saved.send(PROMPTS[0], GREEDY).tokens == expected[0]
    conv_id = saved.conversation.id
    saved.close()
    again = open_session(smollm2_loaded, data_dir=tmp_path, cache=TIGHT, conversation_id=conv_id)
    assert again.send(PROMPTS[1], GREEDY).tokens == expected[1]
    again.close()
