"""`kvchat verify` markov experiment, quick size: patching h_l reproduces A exactly."""

from __future__ import annotations

import pytest

from kvchat.lab.context import LabContext
from kvchat.lab.report import write_results

# The experiment behind every test here runs real models for 15-35 s: the whole file is slow.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    import torch

    from kvchat.lab import markov

    ctx = LabContext(results_dir=tmp_path_factory.mktemp("markov"), quick=True, say=lambda m: None)
    with torch.no_grad():
        section = markov.run(ctx)
    return ctx, section


def _layers_of(ctx, run) -> int:
    from kvchat.lab.tiny_models import tiny_model

    if run["kind"] == "tiny":
        return tiny_model(run["model"]).config.get_text_config().num_hidden_layers
    return ctx.load(run["model"]).model.config.num_hidden_layers


def test_claims_hold(outcome):
    _, section = outcome
    assert section.error is None
    assert [c.held for c in section.claims] == [True, True], [c.evidence for c in section.claims]


def test_every_layer_and_the_final_norm_patched_exactly(outcome):
    ctx, section = outcome
    kinds = {r["kind"] for r in section.data["runs"]}
    assert kinds == {"real", "tiny"}
    for run in section.data["runs"]:
        assert run["tokens"] >= 16
        assert run["points"] == _layers_of(ctx, run) + 1  # layers 0..L-1 and the final norm
        assert run["pairs"], run["model"]
        for pair in run["pairs"]:
            assert pair["a"] != pair["b"]
            assert pair["baseline_kl"] > 0  # the two prompts predict differently
            points = pair["points"]
            assert [p["point"] for p in points] == list(range(run["points"]))
            for p in points:
                assert p["kl"] == 0 and p["logits_equal"] and p["argmax_equal"]
            # One vector is not the state before the last layer; at the final norm it is.
            assert all(p["control_kl"] > 0 for p in points[:-1])
            assert points[-1]["control_kl"] == 0


def test_table_figure_and_report(outcome, tmp_path):
    ctx, section = outcome
    (table,) = section.tables
    assert len(table.rows) == len(section.data["runs"])
    assert section.figures == ["figures/markov_kl_per_layer.png"]
    assert (ctx.results_dir / section.figures[0]).read_bytes()[:4] == b"\x89PNG"
    paths = write_results(tmp_path, "verify", [section], {})
    assert "whole state" in paths["markdown"].read_text()
