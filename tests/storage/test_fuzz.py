"""The manifest and segment readers under hypothesis: random bytes, truncations, mutated JSON.

Whatever is on disk, a reader either works or raises one StorageError with a one-line
message; it never lets another exception out, and a damaged conversation never affects the
others. Sizes are kept small so the whole module runs in well under 30 s.
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

from kvchat.errors import StorageError
from kvchat.storage import ConversationStore, SegmentInfo
from kvchat.storage import segments as seg
from kvchat.storage.manifest import CHECKSUM_KEY, content_checksum
from tests.storage.test_store import new, save_turns

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
def template(tmp_path_factory):
    """A store with a damaged-to-be conversation and a good one, built once; each example
    restores the damaged one's files from the pristine copy first."""
    root = tmp_path_factory.mktemp("fuzz")
    store = ConversationStore(root / "data")
    bad, good = new(store), new(store)
    save_turns(bad, 2)
    save_turns(good, 1)
    bad.close(), good.close()
    pristine = root / "pristine"
    shutil.copytree(bad.path, pristine)
    return store, bad.id, good.id, pristine


def restore(store: ConversationStore, cid: str, pristine: Path) -> Path:
    path = store.conversations_dir / cid
    shutil.rmtree(path)
    shutil.copytree(pristine, path)
    return path


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
        lambda: store.export(bad, "md"),
        lambda: store.export(bad, "json"),
        lambda: store.check_not_open(bad),
    ):
        one_line_storage_error(action)
    rows = {r.id: r for r in store.list()}
    assert rows[good].error is None and rows[bad].id == bad
    with store.open(good) as conv:
        conv.read_turn_tensors(1)


@FUZZ
@given(content=st.binary(max_size=600))
@example(content=b"[" * 100_000)  # nesting deep enough to exhaust the parser's recursion
@example(content=b'{"format_version": 1, "settings": ' * 30_000)
def test_manifest_of_random_bytes(template, content):
    store, bad, good, pristine = template
    path = restore(store, bad, pristine)
    (path / "manifest.json").write_bytes(content)
    everything_still_works(store, bad, good)


@FUZZ
@given(data=st.data())
def test_manifest_truncated_or_bit_flipped(template, data):
    store, bad, good, pristine = template
    path = restore(store, bad, pristine)
    raw = bytearray((path / "manifest.json").read_bytes())
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="keep")]
    else:
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            at = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    (path / "manifest.json").write_bytes(bytes(raw))
    everything_still_works(store, bad, good)


def _nodes(value, trail=()):
    """Every (container, key) pair inside a parsed JSON document."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, child in items:
        yield value, key
        if isinstance(child, (dict, list)) and child:
            yield from _nodes(child, (*trail, key))


@FUZZ
@given(data=st.data())
def test_manifest_with_mutated_json(template, data):
    """Values replaced or removed anywhere in the document, with the checksum recomputed
    (or not) so the mutation reaches the structural checks and everything behind them."""
    store, bad, good, pristine = template
    path = restore(store, bad, pristine)
    doc = json.loads((path / "manifest.json").read_text())
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        nodes = list(_nodes(doc))
        container, key = nodes[data.draw(st.integers(0, len(nodes) - 1), label="node")]
        if data.draw(st.booleans(), label="remove") and isinstance(container, dict):
            del container[key]
        else:
            container[key] = data.draw(json_values, label="value")
    if data.draw(st.booleans(), label="reseal"):
        doc[CHECKSUM_KEY] = content_checksum(doc)
    (path / "manifest.json").write_text(json.dumps(doc))
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
