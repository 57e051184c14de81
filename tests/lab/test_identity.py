"""`kvchat verify` identity experiment, quick size: recomputed K/V equal DynamicCache's."""

from __future__ import annotations

import math

import pytest

from kvchat.lab.context import LabContext
from kvchat.lab.report import write_results

# The experiment behind every test here runs real models for 15-35 s: the whole file is slow.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    import torch

    from kvchat.lab import identity

    ctx = LabContext(
        results_dir=tmp_path_factory.mktemp("identity"), quick=True, say=lambda m: None
    )
    with torch.no_grad():
        section = identity.run(ctx)
    return ctx, section


def _layers_of(ctx, run) -> int:
    from kvchat.lab.tiny_models import tiny_model

    if run["kind"] == "tiny":
        return tiny_model(run["model"]).config.get_text_config().num_hidden_layers
    return ctx.load(run["model"], run["dtype"]).model.config.num_hidden_layers


def test_recomputed_kv_are_bit_identical(outcome):
    _, section = outcome
    assert section.error is None
    (claim,) = section.claims
    assert claim.held is True, claim.evidence
    for run in section.data["runs"]:
        summary = run["summary"]
        assert summary["checked"] > 0, f"{run['model']} {run['dtype']}: nothing was cold"
        assert summary["replay_equal"] == summary["checked"]
        assert summary["replay_max"] == 0.0


def test_covers_every_family_both_dtypes_and_a_real_model(outcome):
    from kvchat.lab.tiny_models import FAMILIES

    _, section = outcome
    seen = {(r["model"], r["dtype"]) for r in section.data["runs"]}
    for name in (*FAMILIES, "smollm2-135m"):
        assert {(name, "float32"), (name, "bfloat16")} <= seen


def test_every_layer_has_numbers(outcome):
    ctx, section = outcome
    for run in section.data["runs"]:
        layers = run["layers"]
        assert [row["layer"] for row in layers] == list(range(_layers_of(ctx, run)))
        assert run["recomputed_tokens_during_run"] > 0
        for row in layers:
            assert row["steps_equal"] and row["hot_equal"]
            if row["cold_tokens"] > 0:
                assert row["replay_equal"] is True
                # The naive batched contrast is measured, whatever it gives on this machine.
                assert math.isfinite(row["naive_max_abs"]) and row["naive_max_abs"] >= 0


def test_table_figure_and_report(outcome, tmp_path):
    ctx, section = outcome
    (table,) = section.tables
    assert len(table.rows) == len(section.data["runs"])
    assert section.figures == ["figures/identity_per_layer.png"]
    png = ctx.results_dir / section.figures[0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    paths = write_results(tmp_path, "verify", [section], {})
    assert "bit-identical" in paths["markdown"].read_text()
