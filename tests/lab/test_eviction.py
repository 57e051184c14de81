"""The ``eviction`` bench experiment, run for real in quick mode (SmolLM2, ~1K-token prompt).

Asserts outcomes, not just that it ran: KV-Direct reproduces the unbounded cache at every
budget, the baselines hold their budget and fall below it somewhere, the report has a row per
(budget, policy) and both plots exist.
"""

from __future__ import annotations

import json

import pytest

from kvchat.lab import eviction
from kvchat.lab.context import LabContext
from kvchat.lab.runner import run_suite
from kvchat.lab.suites import experiments

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-eviction")
    ctx = LabContext(out, quick=True, models=("smollm2-135m",), say=lambda m: None)
    sections, paths = run_suite("bench", ctx, experiments("bench", ("eviction",)), "test")
    yield sections[0], paths, out, ctx
    ctx.release()


def test_quick_run_covers_every_policy_and_budget(quick):
    section, _, _, _ = quick
    assert section.error is None, section.data.get("traceback")
    rows = section.data["rows"]
    budgets = section.data["budgets"]
    assert budgets == list(eviction.QUICK_BUDGETS)
    assert sorted((r["budget_fraction"], r["policy"]) for r in rows) == sorted(
        (b, p) for b in budgets for p in eviction.POLICIES
    )
    (workload,) = section.data["workloads"]
    assert workload["prompt_tokens"] >= 1000
    assert all(r["n_tokens"] == workload["generated_tokens"] > 0 for r in rows)


def test_kv_direct_is_exact_at_every_budget(quick):
    section, _, _, _ = quick
    kvd = [r for r in section.data["rows"] if r["policy"] == "kv_direct"]
    assert len(kvd) == len(eviction.QUICK_BUDGETS)
    for r in kvd:
        assert r["token_match"] == 1.0 and r["top1"] == 1.0
        assert r["mean_kl"] == 0.0 and r["first_divergence"] is None
        assert r["bit_identical"]
    claim = section.claims[0]
    assert claim.name.startswith("KV-Direct matches") and claim.held is True


def test_baselines_hold_their_budget_and_lose_tokens(quick):
    section, _, _, ctx = quick
    rows = section.data["rows"]
    loaded = ctx.load("smollm2-135m")
    per_token = loaded.footprint.standard_cache_bytes(1)  # K+V of one token, all layers
    for r in rows:
        if r["policy"] in ("window", "streaming_llm", "h2o", "tova"):
            assert r["kv_bytes"] == r["total_bytes"] == r["budget_tokens"] * per_token
        elif r["policy"] == "snapkv":  # B, plus what it decodes; the whole prompt at prefill
            assert r["budget_tokens"] * per_token < r["kv_bytes"] < r["total_bytes"]
        else:  # KV-Direct: the same hot K/V, plus checkpoints of everything older
            assert r["kv_bytes"] <= (r["budget_tokens"] + r["n_tokens"]) * per_token
            assert r["total_bytes"] > r["kv_bytes"]
    smallest = min(r["budget_fraction"] for r in rows)
    at_smallest = [
        r for r in rows if r["policy"] != "kv_direct" and r["budget_fraction"] == smallest
    ]
    assert any(r["token_match"] < 1.0 for r in at_smallest)
    assert any(r["mean_kl"] > 0.01 for r in at_smallest)


def test_report_has_table_plots_and_raw_numbers(quick):
    section, paths, out, _ = quick
    for fig in section.figures:
        png = out / fig
        assert png.exists() and png.stat().st_size > 10_000
        assert png.read_bytes()[:4] == b"\x89PNG"
    assert {f.split("/")[-1] for f in section.figures} == {
        "eviction_token_match.png",
        "eviction_kl.png",
    }
    report = paths["markdown"].read_text()
    table = section.tables[0]
    assert len(table.rows) == len(section.data["rows"])
    for label in eviction.LABELS.values():
        assert f"| {label}" in report
    data = json.loads(paths["json"].read_text())
    (saved,) = [s for s in data["sections"] if s["key"] == "eviction"]
    assert len(saved["data"]["rows"]) == len(section.data["rows"])


def test_multi_turn_segments_follow_the_chat_template(quick):
    """The ids fed turn by turn are the template's rendering of the whole conversation."""
    from kvchat.lab.texts import CONVERSATION

    _, _, _, ctx = quick
    loaded = ctx.load("smollm2-135m")
    tok = loaded.tokenizer
    wl = eviction.multi_turn(loaded, 12)
    reply_text = "The committee will buy a new tank."
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for reply in (
        tok(reply_text, add_special_tokens=False)["input_ids"] + [im_end],  # ended by itself
        tok(reply_text, add_special_tokens=False)["input_ids"],  # cut at max_new
    ):
        fed = wl.first + reply + wl.follow(1, reply)
        messages = [
            {"role": "user", "content": CONVERSATION[0]},
            {"role": "assistant", "content": reply_text},
            {"role": "user", "content": CONVERSATION[1]},
        ]
        expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.decode(fed) == expected
