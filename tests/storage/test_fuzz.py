"""The manifest, journal and segment readers under hypothesis: random bytes, truncations,
mutated JSON, records resealed, dropped or reordered.

Whatever is on disk, a reader either works or raises one StorageError with a one-line
message; it never lets another exception out, and a damaged conversation never affects the
others. Sizes are kept small so the whole module runs in well under 30 s; that is still
most of the storage tests' time, so it runs in the full suite, not the fast loop.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvchat.commands.export import export_text
from kvchat.errors import StorageError
from kvchat.storage import ConversationStore, SegmentInfo
from kvchat.storage import segments as seg
from kvchat.storage.folder import read_manifest
from kvchat.storage.journal import JOURNAL_NAME, seal
from kvchat.storage.manifest import CHECKSUM_KEY, content_checksum
from tests.storage.test_journal import FIXTURE, FIXTURE_ID
from tests.storage.test_store import new, save_turns

pytestmark = pytest.mark.slow

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """One store holding a good conversation and, per kind, a damaged-to-be one, built once;
    each example restores the damaged one's files from its pristine copy first. Kinds: a
    journal conversation (header without turns), one of the old format (one manifest.json
    holding every turn), and an old one migrated by a save (header with turns, then a
    record)."""
    root = tmp_path_factory.mktemp("fuzz")
    store = ConversationStore(root / "data")
    journal, good = new(store), new(store)
    save_turns(journal, 2)
    save_turns(good, 1)
    journal.close(), good.close()
    old = store.conversations_dir / FIXTURE_ID
    shutil.copytree(FIXTURE, old)
    migrated = store.conversations_dir / (FIXTURE_ID + "-m")
    shutil.copytree(FIXTURE, migrated)
    with store.open(migrated.name) as conv:
        save_turns(conv, 2)
    kinds = {}
    for kind, path in (("journal", journal.path), ("old", old), ("migrated", migrated)):
        pristine = root / f"pristine-{kind}"
        shutil.copytree(path, pristine, ignore=shutil.ignore_patterns("lock"))
        kinds[kind] = (path.name, pristine)
        ORIGINAL[path.name] = read_manifest(path)
    return store, kinds, good.id


ORIGINAL: dict = {}
"""Each damaged-to-be conversation as saved, to compare what a damaged one reads as."""


def restore(store: ConversationStore, cid: str, pristine: Path) -> Path:
    path = store.conversations_dir / cid
    shutil.rmtree(path)
    shutil.copytree(pristine, path)
    return path


KINDS = ("journal", "old", "migrated")
JOURNAL_KINDS = ("journal", "migrated")


def restored(templates, kind: str):
    """(store, damaged id, good id, its folder) with the ``kind`` conversation restored."""
    store, kinds, good = templates
    bad, pristine = kinds[kind]
    return store, bad, good, restore(store, bad, pristine)


def one_line_storage_error(action) -> None:
    try:
        action()
    except StorageError as e:
        assert "\n" not in str(e) and str(e)


def everything_still_works(store: ConversationStore, bad: str, good: str) -> None:
    """Every reader on the damaged conversation, then the good one, untouched."""

    def read_all_turns():
        with store.open(bad) as conv:
            for turn in conv.manifest.turns:
                conv.read_turn_tensors(turn.index)
                conv.tensor_layout(turn.index)
            list(conv.iter_tensors())

    for action in (
        read_all_turns,
        lambda: export_text(store, bad, "md"),
        lambda: export_text(store, bad, "json"),
        lambda: store.check_not_open(bad),
    ):
        one_line_storage_error(action)
    rows = {r.id: r for r in store.list()}
    assert rows[good].error is None and rows[bad].id == bad
    with store.open(good) as conv:
        conv.read_turn_tensors(1)


@FUZZ
@given(content=st.binary(max_size=600), kind=st.sampled_from(KINDS))
@example(content=b"[" * 100_000, kind="journal")  # nesting deep enough to exhaust the parser
@example(content=b"[" * 100_000, kind="old")
@example(content=b'{"format_version": 1, "settings": ' * 30_000, kind="old")
@example(content=b'{"format_version": 2, "settings": ' * 30_000, kind="journal")
def test_manifest_of_random_bytes(templates, content, kind):
    store, bad, good, path = restored(templates, kind)
    (path / "manifest.json").write_bytes(content)
    everything_still_works(store, bad, good)


def truncate_or_flip(raw: bytearray, data) -> bytearray:
    if data.draw(st.booleans(), label="truncate"):
        return raw[: data.draw(st.integers(0, len(raw) - 1), label="keep")]
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    return raw


@FUZZ
@given(data=st.data(), kind=st.sampled_from(KINDS))
def test_manifest_truncated_or_bit_flipped(templates, data, kind):
    store, bad, good, path = restored(templates, kind)
    raw = bytearray((path / "manifest.json").read_bytes())
    (path / "manifest.json").write_bytes(bytes(truncate_or_flip(raw, data)))
    everything_still_works(store, bad, good)


def _nodes(value, trail=()):
    """Every (container, key) pair inside a parsed JSON document."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, child in items:
        yield value, key
        if isinstance(child, (dict, list)) and child:
            yield from _nodes(child, (*trail, key))


def mutate_json(doc, data) -> None:
    """Values replaced or removed anywhere in the document."""
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        nodes = list(_nodes(doc))
        if not nodes:
            return
        container, key = nodes[data.draw(st.integers(0, len(nodes) - 1), label="node")]
        if data.draw(st.booleans(), label="remove") and isinstance(container, dict):
            del container[key]
        else:
            container[key] = data.draw(json_values, label="value")


@FUZZ
@given(data=st.data(), kind=st.sampled_from(KINDS))
def test_manifest_with_mutated_json(templates, data, kind):
    """Values replaced or removed anywhere in the document, with the checksum recomputed
    (or not) so the mutation reaches the structural checks and everything behind them."""
    store, bad, good, path = restored(templates, kind)
    doc = json.loads((path / "manifest.json").read_text())
    mutate_json(doc, data)
    if data.draw(st.booleans(), label="reseal"):
        doc[CHECKSUM_KEY] = content_checksum(doc)
    (path / "manifest.json").write_text(json.dumps(doc))
    everything_still_works(store, bad, good)


# -- the journal --------------------------------------------------------------------------


@FUZZ
@given(content=st.binary(max_size=600), kind=st.sampled_from(JOURNAL_KINDS))
@example(content=b"[" * 100_000 + b"\n", kind="journal")
@example(content=b"\n" * 1000, kind="journal")
def test_journal_of_random_bytes(templates, content, kind):
    store, bad, good, path = restored(templates, kind)
    (path / JOURNAL_NAME).write_bytes(content)
    everything_still_works(store, bad, good)


@FUZZ
@given(data=st.data(), kind=st.sampled_from(JOURNAL_KINDS))
def test_journal_truncated_bit_flipped_or_appended_to(templates, data, kind):
    store, bad, good, path = restored(templates, kind)
    raw = bytearray((path / JOURNAL_NAME).read_bytes())
    if data.draw(st.booleans(), label="append"):
        raw += data.draw(st.binary(max_size=200), label="tail")
    else:
        raw = truncate_or_flip(raw, data)
    (path / JOURNAL_NAME).write_bytes(bytes(raw))
    never_misread(store, bad)
    everything_still_works(store, bad, good)


def never_misread(store: ConversationStore, bad: str) -> None:
    """Damaged bytes are refused or, as a torn last record, dropped: what opens is always
    the first turns as saved, never altered ones."""
    try:
        with store.open(bad) as conv:
            got = conv.manifest
    except StorageError:
        return
    want = ORIGINAL[bad]
    n = len(got.turns)
    assert got.turns == want.turns[:n]
    assert got.messages == want.messages[: len(got.messages)]
    assert got.token_ids == want.token_ids[: len(got.token_ids)]
    assert len(got.token_ids) == (got.turns[-1].n_tokens_total_after if n else 0)


@FUZZ
@given(data=st.data(), kind=st.sampled_from(JOURNAL_KINDS))
def test_journal_with_mutated_records(templates, data, kind):
    """A record's values replaced or removed, resealed (or not), or records dropped,
    duplicated or swapped."""
    store, bad, good, path = restored(templates, kind)
    lines = (path / JOURNAL_NAME).read_bytes().splitlines(keepends=True)
    kind = data.draw(st.sampled_from(["mutate", "reorder"]), label="how")
    if kind == "mutate":
        at = data.draw(st.integers(0, len(lines) - 1), label="line")
        record = json.loads(lines[at])
        mutate_json(record, data)
        lines[at] = json.dumps(record).encode() + b"\n"
        if data.draw(st.booleans(), label="reseal") and isinstance(record, dict):
            record.pop(CHECKSUM_KEY, None)
            try:
                lines[at] = seal(record)
            except ValueError:  # NaN / infinity, or nothing left: kvchat never seals those
                pass  # the unsealed line above (Python writes "Infinity") stays
    else:
        order = data.draw(st.lists(st.integers(0, len(lines) - 1), max_size=4), label="order")
        lines = [lines[i] for i in order]
    (path / JOURNAL_NAME).write_bytes(b"".join(lines))
    everything_still_works(store, bad, good)


# -- segments -----------------------------------------------------------------------------


def segment_readers(path: Path, content: bytes, honest_checksum: bool):
    """Each public segment reader on ``content``. With ``honest_checksum`` the manifest's
    record matches the bytes (a buggy writer), so the parsers behind the check are reached."""
    digest = hashlib.sha256(content).hexdigest() if honest_checksum else "0" * 64
    info = SegmentInfo(file=path.name, sha256=digest, nbytes=len(content))
    seg.forget(path)
    return [
        lambda: seg.verify(path, info, "C1"),
        lambda: seg.read_segment(path, info, "C1"),
        lambda: seg.tensor_layout(path, "C1"),
        lambda: list(seg.iter_segment(path, info, "C1")),
        lambda: seg.read_slice(path, info, "C1", "positions", 0, 1),
    ]


def check_segment_readers(content: bytes, honest_checksum: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "turn-0001.safetensors"
        path.write_bytes(content)
        for read in segment_readers(path, content, honest_checksum):
            try:
                read()
            except (KeyError, IndexError):
                pass  # caller errors of read_slice (no such tensor or rows): not damage
            except StorageError as e:
                assert "\n" not in str(e) and "turn-0001.safetensors" in str(e)


@pytest.fixture(scope="module")
def valid_segment():
    from tests.storage.test_store import turn_tensors

    data, _ = seg.encode(turn_tensors(3, n=6))
    return data


@FUZZ
@given(content=st.binary(max_size=400), honest=st.booleans())
@example(content=b"\xff" * 8 + b"{}", honest=True)  # a header length past the file's end
def test_segment_of_random_bytes(content, honest):
    check_segment_readers(content, honest)


@FUZZ
@given(data=st.data())
def test_segment_truncated_flipped_or_with_a_mutated_header(valid_segment, data):
    raw = bytearray(valid_segment)
    kind = data.draw(st.sampled_from(["truncate", "flip", "header"]), label="kind")
    if kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="keep")]
    elif kind == "flip":
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            at = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    else:
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        nodes = list(_nodes(header))
        container, key = nodes[data.draw(st.integers(0, len(nodes) - 1), label="node")]
        container[key] = data.draw(json_values, label="value")
        head = json.dumps(header).encode()
        raw = bytearray(struct.pack("<Q", len(head)) + head + raw[8 + n :])
    check_segment_readers(bytes(raw), data.draw(st.booleans(), label="honest"))
