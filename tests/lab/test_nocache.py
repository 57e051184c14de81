"""`kvchat verify` nocache experiment, quick size: no cache at all, same greedy tokens."""

from __future__ import annotations

import math

import pytest

from kvchat.lab.context import LabContext
from kvchat.lab.report import write_results

# A real model runs behind every test here (the module fixture): the whole file is slow.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    import torch

    from kvchat.lab import nocache

    ctx = LabContext(results_dir=tmp_path_factory.mktemp("nocache"), quick=True, say=lambda m: None)
    with torch.no_grad():
        section = nocache.run(ctx)
    return ctx, section


def test_greedy_tokens_identical_without_a_cache(outcome):
    _, section = outcome
    assert section.error is None
    (claim,) = section.claims
    assert claim.held is True, claim.evidence
    runs = section.data["runs"]
    assert {r["kind"] for r in runs} == {"real", "tiny"}
    for run in runs:
        assert run["reference_tokens"] == run["nocache_tokens"]
        assert run["token_match"] == 1.0 and run["first_divergence"] is None


def test_logit_difference_reported_every_step(outcome):
    _, section = outcome
    for run in section.data["runs"]:
        diffs = run["max_abs_logit_diff_per_step"]
        assert len(diffs) == run["new_tokens"] > 0
        assert all(math.isfinite(d) and 0 <= d < 1e-2 for d in diffs), (run["model"], diffs)


def test_real_model_answers_a_chat_question(outcome):
    _, section = outcome
    (real,) = [r for r in section.data["runs"] if r["kind"] == "real"]
    assert real["model"] == "smollm2-135m" and real["prompt"].startswith("chat:")
    assert real["text"].strip()


def test_table_figure_and_report(outcome, tmp_path):
    ctx, section = outcome
    assert len(section.tables[0].rows) == len(section.data["runs"])
    assert section.figures == ["figures/nocache_logit_diff.png"]
    assert (ctx.results_dir / section.figures[0]).read_bytes()[:4] == b"\x89PNG"
    paths = write_results(tmp_path, "verify", [section], {})
    assert "token-identical" in paths["markdown"].read_text()
