"""Run a list of experiments, keep going past a failed one, write the results directory."""

from __future__ import annotations

import datetime as dt
import platform
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from kvchat.lab import harness
from kvchat.lab.context import LabContext
from kvchat.lab.report import Claim, Section, write_results

Experiment = Callable[[LabContext], Section]


def machine_line(device: str) -> str:
    import os

    import torch

    line = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    if device.startswith("cuda") and torch.cuda.is_available():
        line += f", {torch.cuda.get_device_name()}"
    return line


def run_suite(
    kind: str,
    ctx: LabContext,
    experiments: Sequence[tuple[str, Experiment]],
    command: str,
) -> tuple[list[Section], dict[str, Path]]:
    """Run every experiment in order; one that raises becomes a failed section, not a crash."""
    import torch

    sections: list[Section] = []
    for key, experiment in experiments:
        ctx.say(f"{kind}: {key} ...")
        elapsed = harness.stopwatch()
        try:
            with torch.no_grad():
                section = experiment(ctx)
        except Exception as exc:  # noqa: BLE001 - a failed experiment is a result too
            section = Section(key=key, title=key, error=f"{type(exc).__name__}: {exc}")
            section.claims.append(Claim(f"{key} ran", False, section.error))
            section.data["traceback"] = traceback.format_exc()
        section.seconds = elapsed()
        ctx.say(f"{kind}: {key} done in {section.seconds:.1f} s")
        sections.append(section)
    meta = {
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line(ctx.device),
        "device": ctx.device,
        "quick": ctx.quick,
        "threads": torch.get_num_threads(),
        "environment": harness.environment(torch.get_num_threads()),
    }
    paths = write_results(ctx.results_dir, kind, sections, meta)
    return sections, paths
