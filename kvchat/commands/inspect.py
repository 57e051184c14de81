"""The commands that answer without loading weights: ``models`` and ``inspect``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from kvchat.commands.terminal import fail
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.engine.kvdirect.footprint import ModelFootprint


def measured_costs(fp: ModelFootprint, dtype: str, data_dir: str | None) -> dict[str, Any]:
    """Read and recompute costs on this CPU and the data dir's disk (cached after once)."""
    from dataclasses import asdict

    import torch

    from kvchat.engine.kvdirect.costs import device_costs
    from kvchat.paths import data_dir as resolve_data_dir

    dt = "float32" if dtype == "auto" else dtype
    costs = device_costs(fp, torch.device("cpu"), dt, resolve_data_dir(data_dir))
    from kvchat.engine.kvdirect.costs import shape_key

    layer = fp.layers[0]
    shapes = {shape_key(x) for x in fp.layers}
    report = asdict(costs)
    report["recompute_rows_per_s"] = {
        k: v for k, v in report["recompute_rows_per_s"].items() if k in shapes
    }
    return {
        **report,
        "per_cold_token_step_seconds": {
            form: costs.step_cost(layer, form) for form in ("kv", "residual")
        },
        "auto_chooses": sorted({costs.cheaper_form(x) for x in fp.layers}),
    }


def render_costs(costs: dict[str, Any]) -> str:
    step = costs["per_cold_token_step_seconds"]
    rates = "; ".join(
        f"{shape}: {r['1']:.0f} rows/s one by one, {r['256']:.0f} rows/s in 256-row calls"
        for shape, r in costs["recompute_rows_per_s"].items()
    )
    return (
        f"\nMeasured on this machine ({costs['device']}, {costs['dtype']}): memory read "
        f"{costs['memory_read_gbps']:.1f} GB/s, data-dir disk {costs['disk_warm_read_gbps']:.1f} "
        f"GB/s warm / {costs['disk_cold_read_gbps']:.2f} GB/s cold; recompute {rates}.\n"
        f"Bringing one cold token back per step: K/V {1e6 * step['kv']:.2f} us, residual "
        f"{1e6 * step['residual']:.2f} us -> --checkpoint auto picks "
        f"{', '.join(costs['auto_chooses'])}."
    )


def show_models(as_json: bool) -> None:
    """``kvchat models``: one row per alias, and whether it is here already."""
    from kvchat.engine.models.resolve import list_models

    rows = list_models()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'alias':<14} {'local':<6} {'repo':<38} description")
    for row in rows:
        local = "yes" if row.get("available") else "no"
        click.echo(
            f"{row['alias']:<14} {local:<6} {row['repo_id']:<38} {row.get('description', '')}"
        )


def show_inspect(
    model: str, dtype: str, n_tokens: int, as_json: bool, show_costs: bool, data_dir: str | None
) -> None:
    """``kvchat inspect``: bytes per token per layer, and (``--costs``) measured costs."""
    from kvchat.engine.kvdirect.footprint import footprint_from_config, load_config
    from kvchat.engine.kvdirect.inspect_report import inspect_as_dict, render_inspect

    try:
        fp = footprint_from_config(load_config(model), dtype)
    except KvchatError as exc:
        fail(exc)
    costs = None
    if show_costs:
        costs = measured_costs(fp, dtype, data_dir)
    if as_json:
        report = inspect_as_dict(fp, n_tokens)
        if costs is not None:
            report["costs"] = costs
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render_inspect(fp, n_tokens))
        if costs is not None:
            click.echo(render_costs(costs))
