"""A failing experiment becomes a failed section with its error, not a crash of the run."""

from __future__ import annotations

import json
import sys

import pytest

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


def plotted(ctx: LabContext) -> Section:
    plt = ctx.pyplot("test")
    figures = []
    if plt is not None:
        fig, ax = plt.subplots()
        ax.plot([0, 1], [1, 0])
        figures.append(ctx.save_figure(fig, "line"))
    return Section(key="plotted", title="Plotted", figures=figures)


def test_without_matplotlib_the_reports_are_written_and_the_plots_explained(tmp_path, monkeypatch):
    said: list[str] = []
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    ctx = LabContext(results_dir=tmp_path, say=said.append)
    sections, paths = run_suite("verify", ctx, [("plotted", plotted)], "kvchat verify")
    assert sections[0].error is None and sections[0].figures == []
    assert json.loads(paths["json"].read_text())["sections"][0]["key"] == "plotted"
    assert paths["markdown"].is_file()
    assert any('pip install -e ".[lab]"' in line for line in said), said


def test_with_matplotlib_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    ctx = LabContext(results_dir=tmp_path, say=lambda _m: None)
    sections, _paths = run_suite("verify", ctx, [("plotted", plotted)], "kvchat verify")
    assert sections[0].figures == ["figures/line.png"]
    assert (tmp_path / "figures" / "line.png").stat().st_size > 0
