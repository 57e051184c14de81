"""A failing experiment becomes a failed section with its error, not a crash of the run."""

from __future__ import annotations

import json

from kvchat.lab.context import LabContext
from kvchat.lab.report import Claim, Section, Table
from kvchat.lab.runner import run_suite


def fine(ctx: LabContext) -> Section:
    path, rel = ctx.figure("empty")
    path.write_bytes(b"\x89PNG\r\n\x1a\n")
    return Section(
        key="fine",
        title="Fine",
        tables=[Table(["a", "b"], [[1, 0.5], [2, float("nan")]])],
        figures=[rel],
        claims=[Claim("it works", True, "measured")],
    )


def broken(ctx: LabContext) -> Section:
    raise RuntimeError("no model here")


def test_run_suite_keeps_going_and_records_the_failure(tmp_path):
    ctx = LabContext(results_dir=tmp_path, say=lambda _m: None)
    sections, paths = run_suite("bench", ctx, [("fine", fine), ("broken", broken)], "kvchat x")
    assert [s.key for s in sections] == ["fine", "broken"]
    assert sections[1].error == "RuntimeError: no model here"
    data = json.loads(paths["json"].read_text())
    assert [v["held"] for v in data["verdict"]] == [True, False]
    assert data["sections"][1]["data"]["traceback"].startswith("Traceback")
    report = paths["markdown"].read_text()
    assert "**Failed:** `RuntimeError: no model here`" in report
    assert "![empty](figures/empty.png)" in report and "| 2 | -   |" in report
