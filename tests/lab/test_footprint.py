"""The bytes-per-token verdict, and the results directory `kvchat verify` writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvchat.lab.context import LabContext
from kvchat.lab.footprint import run
from tests.test_cli import kvchat_here


def test_the_headline_is_true_arithmetic_but_per_layer_only_mha_models_save(tmp_path):
    section = run(LabContext(results_dir=tmp_path, say=lambda _m: None))
    claims = {c.name: c for c in section.claims}
    headline = next(c for name, c in claims.items() if name.startswith("Gemma 3 4B"))
    assert headline.held and "ONE layer" in headline.evidence
    per_layer = claims["a residual checkpoint per layer is smaller than that layer's K+V"]
    assert per_layer.held is False
    assert "gpt2" in per_layer.evidence and "smollm2-135m" in per_layer.evidence
    smol = section.data["smollm2-135m"]
    assert smol["residual_per_layer"] == 576 * 2 and smol["kv_per_layer"] == 2 * 3 * 64 * 2


@pytest.mark.slow
def test_kvchat_verify_writes_json_and_a_markdown_report_with_a_verdict(tmp_path):
    out = tmp_path / "results"
    done = kvchat_here("verify", "--only", "footprint", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "2 claims checked, 1 did not hold" in done.stdout
    data = json.loads((out / "results.json").read_text())
    assert data["kind"] == "verify" and data["sections"][0]["key"] == "footprint"
    assert {v["held"] for v in data["verdict"]} == {True, False}
    report = (out / "report.md").read_text()
    assert "## Verdict" in report and "DID NOT HOLD" in report and "kvchat verify" in report


def test_an_unknown_experiment_is_refused_by_the_cli(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "kvchat.cli", "bench", "--only", "nonsense"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "nonsense" in done.stderr
