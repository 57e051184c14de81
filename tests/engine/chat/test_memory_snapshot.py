"""The memory snapshot's one serialization: the keys ``--json`` prints and manifests hold."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from kvchat.engine.chat.memory_snapshot import MemorySnapshot

# The keys of `kvchat run --json`'s "memory" and of each saved turn's extra["memory"], in
# the order they have always been written (README documents them).
KEYS = [
    "cache", "checkpoint", "tokens", "hot_tokens", "checkpointed_tokens", "hot_window",
    "hot_kv_bytes", "checkpoint_bytes", "scratch_peak_bytes", "token_id_bytes", "state_bytes",
    "state_peak_bytes", "standard_equivalent_bytes", "ceiling_bytes", "disk_bytes", "disk_tier",
    "plan", "forms", "streamed_attention", "weights_bytes", "rss_bytes", "recompute_seconds",
    "compute_seconds", "recompute_share", "read_back_seconds", "read_back_share", "kv_dtype",
]  # fmt: skip


def sample() -> MemorySnapshot:
    return MemorySnapshot(
        cache="kvdirect",
        checkpoint="residual",
        tokens=300,
        hot_tokens=64,
        checkpointed_tokens=236,
        hot_window=64,
        hot_kv_bytes=1_474_560,
        checkpoint_bytes=8_156_160,
        scratch_peak_bytes=368_640,
        token_id_bytes=2_400,
        state_bytes=10_001_760,
        state_peak_bytes=10_100_000,
        standard_equivalent_bytes=6_912_000,
        ceiling_bytes=12 * 2**20,
        disk_bytes=0,
        disk_tier=False,
        plan="all in memory",
        forms="residual",
        streamed_attention=False,
        weights_bytes=538_000_000,
        rss_bytes=990_000_000,
        recompute_seconds=0.25,
        compute_seconds=2.5,
        recompute_share=0.1,
        read_back_seconds=0.0,
        read_back_share=0.0,
        kv_dtype="bfloat16",
    )


def test_to_dict_writes_the_documented_keys_in_order():
    assert list(sample().to_dict()) == KEYS


def test_a_snapshot_survives_json_and_back():
    snap = sample()
    assert MemorySnapshot.from_dict(json.loads(json.dumps(snap.to_dict()))) == snap


def test_an_older_saved_dict_still_loads():
    # Written before read_back_*, state_peak_bytes, plan, forms, disk_tier existed, plus
    # a key this version does not know.
    old = {k: v for k, v in sample().to_dict().items() if not k.startswith("read_back")}
    for gone in ("state_peak_bytes", "plan", "forms", "disk_tier", "streamed_attention"):
        del old[gone]
    old["some_later_figure"] = 7
    snap = MemorySnapshot.from_dict(old)
    assert snap.state_bytes == 10_001_760 and snap.tokens == 300
    assert snap.read_back_share == 0.0 and snap.forms is None and snap.disk_tier is False
    assert MemorySnapshot.from_dict({}) == MemorySnapshot()
    assert MemorySnapshot.from_dict(None) == MemorySnapshot()


def test_it_is_frozen_and_holds_plain_values():
    snap = sample()
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.tokens = 1  # type: ignore[misc]
    for value in snap.to_dict().values():
        assert value is None or type(value) in (str, int, float, bool)


def test_importing_it_imports_no_torch_and_nothing_else_of_kvchat():
    code = (
        "import sys; import kvchat.engine.chat.memory_snapshot; "
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'kvchat'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(
        ["kvchat", "kvchat.engine", "kvchat.engine.chat", "kvchat.engine.chat.memory_snapshot"]
    )
