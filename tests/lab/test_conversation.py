"""`kvchat bench` conversation experiment, quick size: state per turn, ceiling, same replies."""

from __future__ import annotations

import json

import pytest

from kvchat.lab.context import LabContext
from kvchat.lab.runner import run_suite

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    from kvchat.lab import conversation

    ctx = LabContext(
        results_dir=tmp_path_factory.mktemp("conversation"), quick=True, say=lambda m: None
    )
    sections, paths = run_suite("bench", ctx, [("conversation", conversation.run)], "test")
    (section,) = sections
    return ctx, section, paths


def _claim(section, start: str):
    matches = [c for c in section.claims if c.name.startswith(start)]
    assert len(matches) == 1, [c.name for c in section.claims]
    return matches[0]


def test_ran_every_turn_with_both_caches(outcome):
    _, section, _ = outcome
    assert section.error is None, section.data.get("traceback")
    runs = section.data["runs"]
    assert runs[0]["label"] == "standard" and runs[0]["completed"]
    kv = runs[-1]
    assert kv["completed"], kv["refused"]
    assert [t["turn"] for t in kv["turns"]] == [1, 2, 3, 4]
    tokens = [t["tokens"] for t in kv["turns"]]
    assert tokens == sorted(tokens) and tokens[0] > 0
    assert [t["tokens"] for t in runs[0]["turns"]] == tokens


def test_state_stays_under_the_ceiling_at_every_turn(outcome):
    _, section, _ = outcome
    claim = _claim(section, "KV-Direct resident state stays under the ceiling")
    assert claim.held is True, claim.evidence
    ceiling = section.data["ceiling_bytes"]
    kv = section.data["runs"][-1]
    for turn in kv["turns"]:
        assert 0 < turn["state_bytes"] <= turn["peak_state_bytes"] <= ceiling
        assert turn["hot_kv_bytes"] + turn["checkpoint_bytes"] <= turn["state_bytes"]
        assert turn["rss_bytes"] > 0
    # the ceiling is below what the standard cache holds by the last turn, so it binds
    assert ceiling < kv["turns"][-1]["standard_equivalent_bytes"]
    assert kv["turns"][-1]["hot_window"] is not None


def test_replies_are_identical_to_the_standard_cache(outcome):
    _, section, _ = outcome
    claim = _claim(section, "replies identical to the standard cache")
    assert claim.held is True, claim.evidence
    match = section.data["token_match"]
    assert match["identical"] and match["same"] == match["total"] > 0
    standard, kv = section.data["runs"][0], section.data["runs"][-1]
    assert standard["reply_tokens"] == kv["reply_tokens"]


def test_claims_table_and_figure_are_written(outcome):
    ctx, section, paths = outcome
    names = [c.name for c in section.claims]
    assert any("grows slower" in n for n in names)
    assert all(c.held is not None and c.evidence for c in section.claims)
    (table, _runs) = section.tables
    assert len(table.rows) == 4
    (figure,) = section.figures
    png = ctx.results_dir / figure
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = paths["markdown"].read_text()
    assert "KV-Direct resident state stays under the ceiling" in report
    assert figure in report
    data = json.loads(paths["json"].read_text())
    assert data["sections"][0]["key"] == "conversation"
