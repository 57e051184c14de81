"""``kvchat verify`` and ``kvchat bench``: run a lab suite and write its report."""

from __future__ import annotations

import sys

import click

from kvchat.commands.terminal import exit_on_termination, fail
from kvchat.errors import KvchatError


def run_lab(
    kind: str, quick: bool, out_dir: str | None, device: str, only: tuple[str, ...]
) -> None:
    """Run suite ``kind`` (its experiments, or just ``only``); exits 1 if one of them failed."""
    from pathlib import Path

    from kvchat.lab.context import LabContext
    from kvchat.lab.runner import run_suite
    from kvchat.lab.suites import experiments

    results = Path(out_dir or f"results/{kind}")
    ctx = LabContext(
        results_dir=results, quick=quick, device=device, say=lambda m: click.echo(m, err=True)
    )
    argv = " ".join(["kvchat", kind, *sys.argv[2:]])
    try:
        with exit_on_termination():  # atexit hooks and finally blocks still run
            sections, paths = run_suite(kind, ctx, experiments(kind, only), command=argv)
    except KvchatError as exc:
        fail(exc)
    failed = [c for s in sections for c in s.claims if c.held is False]
    errors = [s.key for s in sections if s.error]
    click.echo(f"report: {paths['markdown']}  data: {paths['json']}")
    click.echo(f"{sum(len(s.claims) for s in sections)} claims checked, {len(failed)} did not hold")
    if errors:
        click.echo(
            f"kvchat: error: experiments failed: {', '.join(errors)} (see {paths['markdown']})",
            err=True,
        )
        sys.exit(1)
