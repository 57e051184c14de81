"""--max-mem parsing, and how the planner derives the hot window from the ceiling."""

from __future__ import annotations

import pytest

from kvchat.engine.kvdirect.footprint import (
    bundled_config_dict,
    config_from_dict,
    footprint_from_config,
)
from kvchat.engine.kvdirect.planner import GROWTH_RESERVE_ROWS, Planner, choose_forms
from kvchat.errors import NeedsDiskTierError
from kvchat.units import parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64MB", 64_000_000),
        ("512KiB", 512 * 1024),
        ("1.5GB", 1_500_000_000),
        ("2MiB", 2 * 2**20),
        ("4096", 4096),
        ("10 kb", 10_000),
        ("3G", 3_000_000_000),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "MB", "-1MB", "12XB", "1.2.3MB"])
def test_parse_size_rejects_nonsense_with_a_hint(bad):
    with pytest.raises(ValueError, match="64MB"):
        parse_size(bad)


def smollm2_planner(ceiling, checkpoint="residual"):
    fp = footprint_from_config(config_from_dict(bundled_config_dict("smollm2-135m")), "float32")
    return Planner(fp, choose_forms(fp, checkpoint), ceiling, prefill_chunk=256), fp


def test_no_eviction_while_everything_fits():
    planner, _ = smollm2_planner(64 * 2**20)
    assert planner.hot_window_for(100) is None


def test_while_everything_fits_the_windows_grow_in_a_reserve_the_estimate_counts():
    """Under a ceiling that holds every token, each hot window may hold GROWTH_RESERVE_ROWS
    more (a decode step then writes its row there instead of concatenating the window),
    counted in the estimate; where the reserve would not fit, the windows stay compact."""
    planner, fp = smollm2_planner(64 * 2**20, checkpoint="kv")
    plan = planner.plan_exact(100)
    assert not plan.disk_tier and plan.hot_window is None
    assert plan.hot_reserve == GROWTH_RESERVE_ROWS
    per_row = sum(layer.kv_bytes for layer in fp.layers)
    assert plan.estimate.hot_kv == (100 + GROWTH_RESERVE_ROWS) * per_row
    assert plan.estimate.total <= 64 * 2**20
    tight = planner.estimate(100, None).total + GROWTH_RESERVE_ROWS * per_row - 1
    compact = smollm2_planner(tight, checkpoint="kv")[0].plan_exact(100)
    assert not compact.disk_tier and compact.hot_reserve == 0
    assert compact.estimate.hot_kv == 100 * per_row
    assert smollm2_planner(None)[0].plan(100).hot_reserve == GROWTH_RESERVE_ROWS
    assert planner.plan_exact(8192).hot_reserve == 0  # the disk tier: K/V windows' own reserve


def test_hot_window_shrinks_as_the_conversation_grows_and_always_fits():
    ceiling = 64 * 2**20
    planner, _ = smollm2_planner(ceiling)
    windows = [planner.plan_exact(n).hot_window for n in (600, 700, 800, 900)]
    assert all(w is not None for w in windows)
    assert windows == sorted(windows, reverse=True) and windows[0] > windows[-1]
    for n, w in zip((600, 700, 800, 900), windows):
        assert planner.estimate(n, w).total <= ceiling < planner.estimate(n, w + 1).total


def test_memoised_plans_fit_every_length_of_their_block():
    ceiling = 64 * 2**20
    planner, _ = smollm2_planner(ceiling)
    for n in range(590, 660):
        w = planner.hot_window_for(n)
        assert planner.estimate(n, w).total <= ceiling
        assert w <= planner.plan_exact(n).hot_window


def test_checkpoints_over_the_ceiling_move_to_the_disk_tier_and_the_plan_fits():
    ceiling = 2 * 10**6
    planner, _ = smollm2_planner(ceiling, "kv")
    for n in (2000, 8192):
        plan = planner.plan(n)
        assert plan.disk_tier and plan.estimate.total <= ceiling
        # one layer's K/V for the whole context (12 MB at 8K) cannot be handed over whole
        assert plan.stream_chunk is not None


def test_residual_checkpoints_need_room_to_replay_one_forward_call():
    """A residual call is replayed whole (its row count keeps the bits), so a ceiling
    below one prefill chunk's replay is refused, naming what would run, instead of
    replaying it in pieces."""
    with pytest.raises(NeedsDiskTierError, match="--checkpoint kv, or a smaller --prefill-chunk"):
        smollm2_planner(2 * 10**6)[0].plan(2000)
    fp = footprint_from_config(config_from_dict(bundled_config_dict("smollm2-135m")), "float32")
    small_calls = Planner(fp, choose_forms(fp, "residual"), 2 * 10**6, prefill_chunk=32)
    plan = small_calls.plan(2000)
    assert plan.disk_tier and plan.stream_chunk is not None and plan.estimate.total <= 2 * 10**6


def test_disk_tier_keeps_the_bit_identical_path_when_one_layer_fits():
    planner, _ = smollm2_planner(64 * 10**6)
    plan = planner.plan(8192)
    assert plan.disk_tier and plan.stream_chunk is None and plan.hot_window > 0
    assert plan.estimate.total <= 64 * 10**6


def test_a_kv_window_reads_whole_kv_with_a_reserve_the_estimate_counts():
    """Under the disk tier with whole K/V, a K/V-form window holds its rows, the step's row
    and KV_STEP_RESERVE more: the estimate counts all of them, and still fits. Streamed
    plans keep no reserve."""
    from kvchat.engine.kvdirect.planner import KV_STEP_RESERVE

    planner, fp = smollm2_planner(8 * 10**6, checkpoint="kv")
    plan = planner.plan_exact(700)
    assert plan.disk_tier and plan.stream_chunk is None and plan.kv_reserve == KV_STEP_RESERVE
    rows = min(plan.kv_window + KV_STEP_RESERVE + 1, 700)
    assert plan.estimate.hot_kv == rows * sum(layer.kv_bytes for layer in fp.layers)
    assert plan.estimate.total <= 8 * 10**6
    streamed = smollm2_planner(2 * 10**6, checkpoint="kv")[0].plan(8192)
    assert streamed.stream_chunk is not None and streamed.kv_reserve == 0


def test_a_ceiling_too_small_even_for_the_disk_tier_says_what_to_do():
    planner, _ = smollm2_planner(50_000)
    with pytest.raises(NeedsDiskTierError) as err:
        planner.plan(8192)  # 64 KB of token ids alone
    message = str(err.value)
    assert "\n" not in message and "use --max-mem" in message
    # The smallest ceiling it names does run these tokens.
    named = message.split("use --max-mem ")[1].split()[0]
    big_enough, _ = smollm2_planner(parse_size(named))
    assert big_enough.plan(8192).disk_tier


def test_kv_form_over_the_ceiling_moves_kv_to_disk():
    planner, fp = smollm2_planner(2 * 10**6, checkpoint="kv")
    plan = planner.plan(2000)
    assert plan.disk_tier and plan.kv_window is not None and plan.hot_window is None
    roomy, _ = smollm2_planner(400 * 10**6, checkpoint="kv")
    # Everything fits: nothing leaves memory, and the windows grow in their reserve.
    assert roomy.plan(2000) == type(plan)(hot_reserve=GROWTH_RESERVE_ROWS)


def test_auto_picks_kv_for_gqa_and_residual_for_mha():
    _, fp = smollm2_planner(None)
    assert set(choose_forms(fp, "auto")) == {"kv"}
    gpt2 = footprint_from_config(config_from_dict(bundled_config_dict("gpt2")), "float32")
    assert set(choose_forms(gpt2, "auto")) == {"residual"}
    with pytest.raises(ValueError):
        choose_forms(fp, "bogus")
