"""Measured costs behind --checkpoint auto: measured once, cached, and what they decide."""

from __future__ import annotations

import json

import pytest
import torch

from kvchat.engine.kvdirect import costs as costs_module
from kvchat.engine.kvdirect.costs import DeviceCosts, device_costs, shape_key
from kvchat.engine.kvdirect.footprint import (
    bundled_config_dict,
    config_from_dict,
    footprint_from_config,
)
from kvchat.engine.kvdirect.planner import choose_forms
from tests.test_cli import kvchat_here


def footprint(alias: str):
    return footprint_from_config(config_from_dict(bundled_config_dict(alias)), "float32")


def test_costs_are_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("KVCHAT_CACHE_DIR", raising=False)  # it would beat XDG_CACHE_HOME
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fp = footprint("smollm2-135m")
    first = device_costs(fp, torch.device("cpu"), "float32", tmp_path)
    assert first.memory_read_gbps > 0 and first.disk_warm_read_gbps > 0
    assert set(first.recompute_rows_per_s[shape_key(fp.layers[0])]) == {"1", "256"}
    assert list((tmp_path / "cache").rglob("*.json"))

    def no_measuring(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(costs_module, "_disk_read_gbps", no_measuring)
    monkeypatch.setattr(costs_module, "_recompute_rates", no_measuring)
    again = device_costs(fp, torch.device("cpu"), "float32", tmp_path)
    assert again == first
    assert not list(tmp_path.glob(".kvchat-probe-*"))  # the probe file is gone


def test_auto_follows_the_costs_not_only_the_bytes():
    gpt2 = footprint("gpt2")  # multi-head: the residual is the smaller form
    assert set(choose_forms(gpt2, "auto")) == {"residual"}
    key = shape_key(gpt2.layers[0])
    slow_recompute = DeviceCosts("cpu", "float32", 40, 5, 1, {key: {"1": 5e3, "256": 5e4}})
    assert set(choose_forms(gpt2, "auto", slow_recompute)) == {"kv"}
    # Free recompute behind a slow disk (a GPU on a slow drive): the smaller form wins.
    fast_recompute = DeviceCosts(
        "cuda", "bfloat16", 900, 0.05, 0.05, {key: {"1": 1e12, "256": 1e12}}
    )
    assert set(choose_forms(gpt2, "auto", fast_recompute)) == {"residual"}


@pytest.mark.slow
def test_inspect_costs_reports_the_measurement_and_the_choice(tmp_path):
    # KVCHAT_CACHE_DIR would beat XDG_CACHE_HOME: unset for the call, so the cache is fresh.
    env = {"KVCHAT_CACHE_DIR": None, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = kvchat_here(
        "inspect", "smollm2-135m", "--costs", "--json", "--data-dir", str(tmp_path / "data"),
        env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)["costs"]
    assert report["auto_chooses"] == ["kv"]
    assert (
        report["per_cold_token_step_seconds"]["kv"]
        < report["per_cold_token_step_seconds"]["residual"]
    )
