"""ConversationStore and Conversation on real files: round trips, listing, corruption."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from kvchat.commands.export import export_text
from kvchat.errors import StorageError
from kvchat.storage import (
    FORMAT_VERSION,
    AmbiguousConversationError,
    ConversationLockedError,
    ConversationNotFoundError,
    ConversationStore,
    ManifestError,
    ModelMismatchError,
    NewerFormatError,
    SegmentCorruptedError,
)
from kvchat.storage import segments as segments_mod

FP = "sha256:" + "ab" * 32


@pytest.fixture
def store(tmp_path):
    return ConversationStore(tmp_path / "data")


def new(store, **kw):
    args = dict(model_name="smollm2-135m", fingerprint=FP, dtype="bfloat16", settings={})
    args.update(kw)
    return store.create(**args)


def turn_tensors(seed: int, n: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer0.resid": torch.randn(n, 16, generator=g),  # fp32
        "layer1.resid": torch.randn(n, 4, 8, generator=g).to(torch.bfloat16),
        "positions": torch.arange(n, dtype=torch.int64),
    }


def save_turns(conv, n_turns: int) -> list[dict[str, torch.Tensor]]:
    saved = []
    for i in range(1, n_turns + 1):
        t = turn_tensors(i, n=3 + i)
        conv.append_turn(
            messages=[
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"answer {i}"},
            ],
            token_ids=list(range(100 * i, 100 * i + 3 + i)),
            tensors=t,
            extra={"turn": i},
        )
        saved.append(t)
    return saved


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert msg and "\n" not in msg
    return msg


# --------------------------------------------------------------------------- round trips


def test_round_trip_over_several_turns_and_reopen(store):
    conv = new(store, settings={"system": "Be brief.", "max_mem": "64MB"})
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", conv.id)
    saved = save_turns(conv, 3)
    conv.append_turn(messages=[], token_ids=[], tensors={}, engine_state={"chunks": [0, 4]})
    conv.close()
    assert conv.closed

    with store.open(conv.id, fingerprint=FP, dtype="bfloat16") as again:
        m = again.manifest
        assert m.title == "question 1"
        assert m.settings == {"system": "Be brief.", "max_mem": "64MB"}
        assert [msg["content"] for msg in m.messages] == [
            "question 1",
            "answer 1",
            "question 2",
            "answer 2",
            "question 3",
            "answer 3",
        ]
        assert m.token_ids == [100, 101, 102, 103] + list(range(200, 205)) + list(range(300, 306))
        assert [t.n_tokens_total_after for t in m.turns] == [4, 9, 15, 15]
        assert [t.extra for t in m.turns] == [{"turn": 1}, {"turn": 2}, {"turn": 3}, {}]
        assert m.engine_state == {"chunks": [0, 4]}
        for i, t in enumerate(saved, start=1):
            assert_same(again.read_turn_tensors(i), t)
        assert again.read_turn_tensors(4) == {}
        seen = [(i, name) for i, name, _ in again.iter_tensors()]
        assert seen == [(i, n) for i in (1, 2, 3) for n in sorted(saved[0])]
        for i, name, tensor in again.iter_tensors():
            assert torch.equal(tensor, saved[i - 1][name])


def test_engine_state_is_kept_unless_replaced(store):
    with new(store) as conv:
        conv.append_turn(messages=[], token_ids=[1], tensors={}, engine_state={"a": 1})
        conv.append_turn(messages=[], token_ids=[2], tensors={})
        assert conv.manifest.engine_state == {"a": 1}


def test_odd_tensors_are_saved_as_values(store):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    with new(store) as conv:
        conv.append_turn(
            messages=[],
            token_ids=[],
            tensors={
                "t": base.t(),  # non-contiguous
                "g": base.clone().requires_grad_(),
                "s": base[1:3],  # view sharing storage with "t"
                "empty": torch.zeros(0, 6, dtype=torch.bfloat16),
            },
        )
        got = conv.read_turn_tensors(1)
    assert torch.equal(got["t"], base.t()) and torch.equal(got["s"], base[1:3])
    assert torch.equal(got["g"], base) and got["empty"].shape == (0, 6)


def test_open_slice_reads_rows_and_verifies_once(store, monkeypatch):
    calls = []
    real = segments_mod._sha256_file
    monkeypatch.setattr(segments_mod, "_sha256_file", lambda p: calls.append(p) or real(p))
    with new(store) as conv:
        saved = save_turns(conv, 2)
        conv.open_slice(2, "layer0.resid", 0, 1)
        assert calls == []  # written by this process: its checksum is already known
        segments_mod.forget(conv.segment_path(2))
        for start, stop in [(0, 1), (1, 4), (2, 2), (0, 5)]:
            for name in ("layer0.resid", "layer1.resid"):
                got = conv.open_slice(2, name, start, stop)
                assert got.dtype == saved[1][name].dtype
                assert torch.equal(got, saved[1][name][start:stop])
        assert len(calls) == 1  # one file, hashed once in this process
        with pytest.raises(IndexError):
            conv.open_slice(2, "layer0.resid", 3, 99)
        with pytest.raises(KeyError):
            conv.open_slice(2, "nope", 0, 1)
        with pytest.raises(IndexError):
            conv.read_turn_tensors(3)


def test_bad_arguments_fail_before_touching_disk(store):
    with new(store) as conv:
        for kwargs in (
            dict(extra={"x": object()}),
            dict(messages=[{"role": "user"}]),
            dict(token_ids=[1.5]),
            dict(token_ids=[True]),
            dict(engine_state=[1]),
            dict(tensors={"x": [1, 2]}),
        ):
            args = dict(messages=[], token_ids=[], tensors={})
            args.update(kwargs)
            with pytest.raises(TypeError):
                conv.append_turn(**args)
        assert os.listdir(conv.path / "segments") == []
        assert conv.manifest.turns == []


def test_token_ids_may_be_tensor_or_numpy_style_ints(store):
    with new(store) as conv:
        conv.append_turn(messages=[], token_ids=torch.tensor([5, 6]), tensors={})
        assert conv.manifest.token_ids == [5, 6]
        assert all(type(t) is int for t in conv.manifest.token_ids)


def test_create_checks_its_arguments(store):
    with pytest.raises(TypeError):
        new(store, settings=["not", "a", "dict"])
    with pytest.raises(TypeError):
        new(store, fingerprint=None)
    assert store.list() == []


def test_closed_conversation_refuses_work(store):
    conv = new(store)
    conv.close()
    conv.close()  # idempotent
    with pytest.raises(ValueError):
        conv.append_turn(messages=[], token_ids=[], tensors={})
    with pytest.raises(ValueError):
        conv.read_turn_tensors(1)


# --------------------------------------------------------------------------- lookup & lock


def test_id_prefix_lookup(store):
    a, b = new(store), new(store)
    a.close(), b.close()
    assert store.resolve(a.id) == a.id
    common = os.path.commonprefix([a.id, b.id])
    assert store.resolve(a.id[: len(common) + 1]) == a.id
    with store.open(b.id[: len(common) + 1]) as conv:
        assert conv.id == b.id
    with pytest.raises(AmbiguousConversationError) as err:
        store.open(common)
    assert a.id in one_line(err) and b.id in str(err.value)
    for bad in ("", "zzz", "../data", ".", "conversations/" + a.id):
        with pytest.raises(ConversationNotFoundError) as err:
            store.open(bad)
        assert "kvchat list" in one_line(err)


def test_second_open_in_same_process_is_refused(store):
    conv = new(store)
    with pytest.raises(ConversationLockedError) as err:
        store.open(conv.id)
    assert "already open in this kvchat process; close it first" in one_line(err)
    with pytest.raises(ConversationLockedError):
        store.delete(conv.id)
    conv.close()
    store.open(conv.id).close()


def test_model_and_dtype_mismatch_are_refused_and_release_the_lock(store):
    conv = new(store)
    conv.close()
    with pytest.raises(ModelMismatchError) as err:
        store.open(conv.id, fingerprint="sha256:other", dtype="bfloat16")
    msg = one_line(err)
    assert "smollm2-135m" in msg and "sha256:other" in msg and "bfloat16" in msg
    with pytest.raises(ModelMismatchError) as err:
        store.open(conv.id, fingerprint=FP, dtype="float32")
    msg = one_line(err)
    assert "saved with model smollm2-135m (dtype bfloat16" in msg and "dtype float32" in msg
    store.open(conv.id, fingerprint=FP, dtype="bfloat16").close()  # lock was released


# --------------------------------------------------------------------------- list / delete / export


def test_list_delete_export(store):
    assert store.list() == []
    assert not store.root.exists()  # listing creates nothing
    first = new(store)
    save_turns(first, 2)
    first.close()
    second = new(store, model_name="gemma-3-270m")
    second.append_turn(messages=[{"role": "user", "content": "x" * 100}], token_ids=[1], tensors={})
    second.close()

    rows = store.list()
    assert [r.id for r in rows] == [second.id, first.id]  # most recently used first
    row = rows[1]
    assert (row.title, row.model, row.turns, row.tokens, row.error) == (
        "question 1",
        "smollm2-135m",
        2,
        9,
        None,
    )
    seg_bytes = sum(t.segment.nbytes for t in first.manifest.turns)
    assert row.bytes_on_disk > seg_bytes
    assert rows[0].title == "x" * 59 + "…"
    assert rows[0].last_used.tzinfo is not None

    md = export_text(store, first.id[:-1], "md")
    assert md.startswith("# question 1\n")
    assert "## User\n\nquestion 2\n\n## Assistant\n\nanswer 2\n" in md
    doc = json.loads(export_text(store, first.id, "json"))
    assert doc["id"] == first.id and doc["model"]["name"] == "smollm2-135m"
    assert doc["messages"][-1] == {"role": "assistant", "content": "answer 2"}
    with pytest.raises(ValueError):
        export_text(store, first.id, "pdf")

    store.delete(first.id)
    assert [r.id for r in store.list()] == [second.id]
    assert sorted(os.listdir(store.conversations_dir)) == [second.id]
    with pytest.raises(ConversationNotFoundError):
        store.open(first.id)


def test_export_works_while_open(store):
    with new(store) as conv:
        save_turns(conv, 1)
        assert "question 1" in export_text(store, conv.id, "md")


def test_leftovers_of_interrupted_create_and_delete_are_swept(store):
    keep = new(store)
    d = store.conversations_dir
    (d / ".deleting-x-1234").mkdir()
    (d / ".deleting-x-1234" / "junk").write_bytes(b"j")
    (d / ".creating-y-999").mkdir()
    os.utime(d / ".creating-y-999", (0, 0))  # abandoned long ago
    (d / ".creating-z-998").mkdir()  # may be a create running in another process right now
    assert [r.id for r in store.list()] == [keep.id]  # hidden folders are not listed
    new(store).close()
    assert not (d / ".deleting-x-1234").exists()
    assert not (d / ".creating-y-999").exists()
    assert (d / ".creating-z-998").exists()
    keep.close()


def test_orphans_of_an_interrupted_save_are_cleaned_on_open(store):
    conv = new(store)
    save_turns(conv, 1)
    conv.close()
    seg = conv.path / "segments"
    debris = [
        seg / "turn-0002.safetensors",
        seg / ".turn-0002.safetensors.tmp-1-abcd",
        conv.path / ".manifest.json.tmp-1-abcd",
    ]
    for p in debris:
        p.write_bytes(b"partial")
    (seg / "notes.txt").write_text("not ours")
    with store.open(conv.id) as again:
        assert sorted(os.listdir(seg)) == ["notes.txt", "turn-0001.safetensors"]
        assert not (conv.path / ".manifest.json.tmp-1-abcd").exists()
        again.append_turn(messages=[], token_ids=[7], tensors=turn_tensors(9))
        assert_same(again.read_turn_tensors(2), turn_tensors(9))


# --------------------------------------------------------------------------- corruption


def flip_byte(path, offset_from_end=3):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_bit_flipped_segment_is_reported_and_the_rest_still_works(store):
    conv = new(store)
    saved = save_turns(conv, 3)
    other = new(store)
    save_turns(other, 1)
    other.close()
    conv.close()
    flip_byte(conv.path / "segments" / "turn-0002.safetensors")

    with store.open(conv.id) as again:
        with pytest.raises(SegmentCorruptedError) as err:
            again.read_turn_tensors(2)
        msg = one_line(err)
        assert "turn-0002.safetensors" in msg and conv.id in msg
        assert "checksum mismatch" in msg and f"kvchat export {conv.id}" in msg
        with pytest.raises(SegmentCorruptedError):
            again.open_slice(2, "layer0.resid", 0, 1)
        assert_same(again.read_turn_tensors(1), saved[0])
        assert_same(again.read_turn_tensors(3), saved[2])
        it = again.iter_tensors()
        assert [next(it)[0] for _ in range(3)] == [1, 1, 1]
        with pytest.raises(SegmentCorruptedError):
            next(it)
    assert {r.id for r in store.list()} == {conv.id, other.id}
    assert "answer 3" in export_text(store, conv.id, "md")
    with store.open(other.id) as o:
        o.read_turn_tensors(1)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_truncated_or_missing_segment(store, damage):
    conv = new(store)
    save_turns(conv, 2)
    conv.close()
    seg = conv.path / "segments" / "turn-0002.safetensors"
    if damage == "truncate":
        seg.write_bytes(seg.read_bytes()[:50])
    else:
        seg.unlink()
    with store.open(conv.id) as again:
        with pytest.raises(SegmentCorruptedError) as err:
            again.read_turn_tensors(2)
        assert ("truncated" if damage == "truncate" else "missing") in one_line(err)
        again.read_turn_tensors(1)
    (row,) = store.list()
    assert row.turns == 2 and "turn-0002.safetensors" in row.error


@pytest.mark.parametrize("content", [b"", b"{not json", b"\xff\xfe", b'{"format_version": 1}'])
def test_unreadable_manifest(store, content):
    bad, good = new(store), new(store)
    bad.close(), good.close()
    (bad.path / "manifest.json").write_bytes(content)
    for _ in range(2):  # the failed open released its lock: same error again, not "locked"
        with pytest.raises(ManifestError) as err:
            store.open(bad.id)
        assert str(bad.path / "manifest.json") in one_line(err)
    with pytest.raises(ManifestError):
        export_text(store, bad.id, "md")
    rows = {r.id: r for r in store.list()}
    assert rows[good.id].error is None
    assert "manifest.json" in rows[bad.id].error
    assert rows[bad.id].bytes_on_disk == len(content)  # lock file is empty once released
    store.open(good.id).close()
    store.delete(bad.id)  # the way out the message suggests
    assert [r.id for r in store.list()] == [good.id]


def test_missing_manifest(store):
    (store.conversations_dir / "20260101-000000-abcd").mkdir(parents=True)
    with pytest.raises(ManifestError) as err:
        store.open("20260101")
    assert "is missing" in one_line(err)
    (row,) = store.list()
    assert row.error


def test_newer_format_version(store):
    conv = new(store)
    conv.close()
    path = conv.path / "manifest.json"
    data = json.loads(path.read_text())
    data["format_version"] = FORMAT_VERSION + 1
    path.write_text(json.dumps(data))
    with pytest.raises(NewerFormatError) as err:
        store.open(conv.id)
    assert one_line(err) == (
        f"conversation {conv.id} was saved by a newer kvchat "
        f"(format {FORMAT_VERSION + 1} > {FORMAT_VERSION}); upgrade kvchat to open it"
    )
    (row,) = store.list()
    assert "newer kvchat" in row.error
    assert isinstance(err.value, StorageError)
