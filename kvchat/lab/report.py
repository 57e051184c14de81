"""Results of the lab experiments and how they are written: JSON, Markdown, PNG paths."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvchat.lab.harness import markdown_table, write_json


@dataclass
class Claim:
    """One statement the product rests on, and whether this run found it true.

    ``held`` is None when the run could not decide (e.g. the experiment was skipped).
    """

    name: str
    held: bool | None
    evidence: str


@dataclass
class Table:
    headers: list[str]
    rows: list[list[Any]]
    caption: str = ""

    def markdown(self) -> str:
        text = markdown_table(self.headers, [[_cell(c) for c in r] for r in self.rows])
        return f"{self.caption}\n\n{text}" if self.caption else text


@dataclass
class Section:
    """What one experiment produced."""

    key: str
    title: str
    summary: str = ""
    tables: list[Table] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)  # paths relative to the results dir
    claims: list[Claim] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None

    def markdown(self) -> str:
        parts = [f"## {self.title}", ""]
        if self.error:
            parts += [f"**Failed:** `{self.error}`", ""]
        if self.summary:
            parts += [self.summary.strip(), ""]
        for table in self.tables:
            parts += [table.markdown(), ""]
        for fig in self.figures:
            parts += [f"![{Path(fig).stem}]({fig})", ""]
        parts.append(f"_{self.seconds:.1f} s_")
        return "\n".join(parts)


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value == 0:
            return "0"
        if abs(value) >= 1000 or abs(value) < 1e-3:
            return f"{value:.3g}"
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def verdict_markdown(sections: Sequence[Section]) -> str:
    rows = []
    for section in sections:
        for claim in section.claims:
            mark = {True: "held", False: "DID NOT HOLD", None: "not decided"}[claim.held]
            rows.append([claim.name, mark, claim.evidence])
    table = Table(["claim", "verdict", "evidence"], rows)
    return "## Verdict\n\n" + (table.markdown() if rows else "No claims were checked.")


def write_results(
    results_dir: Path, kind: str, sections: Sequence[Section], meta: dict[str, Any]
) -> dict[str, Path]:
    """Write ``results.json`` and ``report.md``; figures are already in ``figures/``."""
    results_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "kind": kind,
        "meta": meta,
        "sections": [asdict(s) for s in sections],
        "verdict": [{"section": s.key, **asdict(c)} for s in sections for c in s.claims],
    }
    json_path = write_json(results_dir / "results.json", payload)
    command = meta.get("command", f"kvchat {kind}")
    header = [
        f"# kvchat {kind} report",
        "",
        f"Made by `{command}` on {meta.get('date', '?')} ({meta.get('machine', '?')}).",
        "",
    ]
    body = [verdict_markdown(sections), ""] + [s.markdown() + "\n" for s in sections]
    md_path = results_dir / "report.md"
    md_path.write_text("\n".join(header + body))
    return {"json": json_path, "markdown": md_path}
