"""The one measuring harness: timing, interleaved repeats, medians, ratios, tables, JSON.

Known inputs, exact answers; and the benchmark scripts use it instead of helpers of their own.
"""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.lab import harness

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("bench_*.py"))


def fake_clock(*readings: float):
    """A clock that returns ``readings`` in order, as perf_counter would."""
    it = iter(readings)
    return lambda: next(it)


# -- timing --------------------------------------------------------------------------------
def test_stopwatch_reads_the_seconds_since_it_started():
    elapsed = harness.stopwatch(fake_clock(10.0, 10.5, 12.0))
    assert elapsed() == 0.5
    assert elapsed() == 2.0


def test_intervals_between_stamps():
    assert harness.intervals([1.0, 1.5, 3.0, 3.25]) == [0.5, 1.5, 0.25]
    assert harness.intervals([1.0]) == []


def test_seconds_per_op_back_to_back_is_one_reading_over_all_calls():
    calls = []
    sync = []
    seconds = harness.seconds_per_op(
        lambda: calls.append(1), inner=4, sync=lambda: sync.append(1), clock=fake_clock(2.0, 3.0)
    )
    assert seconds == 0.25 and len(calls) == 4
    assert len(sync) == 2  # before the first reading and before the last


def test_seconds_per_op_with_prepare_times_each_call_alone():
    order = []
    # three calls: 1 s, 2 s, 3 s; prepare runs outside the readings
    clock = fake_clock(0.0, 1.0, 10.0, 12.0, 20.0, 23.0)
    seconds = harness.seconds_per_op(
        lambda: order.append("op"), prepare=lambda: order.append("prep"), inner=3, clock=clock
    )
    assert seconds == 2.0
    assert order == ["prep", "op"] * 3


def test_synchronizer_is_a_no_op_on_cpu():
    assert harness.synchronizer("cpu")() is None


def test_drop_pages_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 10_000)
    if not harness.CAN_DROP_PAGES:
        pytest.skip("no posix_fadvise here")
    harness.drop_pages(path)
    assert path.read_bytes() == b"x" * 10_000


# -- repeating -----------------------------------------------------------------------------
def test_rotated():
    assert harness.rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert harness.rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert harness.rotated(["a", "b", "c"], 5) == ["c", "a", "b"]
    assert harness.rotated([], 3) == []


def test_interleaved_rotates_the_order_and_keeps_results_per_item():
    seen = []
    settled = []

    def measure(item, rep):
        seen.append((rep, item))
        return f"{item}{rep}"

    runs = harness.interleaved(["a", "b", "c"], 3, measure, settle=lambda: settled.append(1))
    assert [item for _, item in seen] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [rep for rep, _ in seen] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert runs == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"], "c": ["c0", "c1", "c2"]}
    assert list(runs) == ["a", "b", "c"]
    assert len(settled) == 9  # before every measurement


def test_interleaved_stride_and_tuple_items():
    items = [(1, "x"), (2, "y"), (3, "z"), (4, "w")]
    order = []
    harness.interleaved(items, 2, lambda item, rep: order.append(item), stride=3, settle=None)
    assert order == items + [items[3], items[0], items[1], items[2]]


# -- statistics ----------------------------------------------------------------------------
def test_median_leaves_out_unknowns():
    assert harness.median([3.0, 1.0, 2.0]) == 2.0
    assert harness.median([4.0, 1.0, None, float("nan"), 2.0, 3.0]) == 2.5
    assert math.isnan(harness.median([]))
    assert math.isnan(harness.median([None, float("nan")]))


def test_spread_is_range_over_median():
    assert harness.spread([9.0, 10.0, 12.0]) == pytest.approx(0.3)
    assert harness.spread([5.0]) == 0.0
    assert harness.spread([5.0, None]) == 0.0
    assert math.isnan(harness.spread([0.0, 0.0, 1.0]))


def test_paired_ratios_pair_by_pair_and_by_key():
    base = [{"s": 2.0}, {"s": 3.0}, {"s": 4.0}]
    runs = [{"s": 1.0}, {"s": 2.0}, {"s": 0.0}]
    ratios = harness.paired_ratios(base, runs, "s")
    assert ratios[:2] == [2.0, 1.5]
    assert math.isnan(ratios[2])  # no denominator: NaN, the list stays aligned with repeats
    assert harness.median_ratio(base, runs, "s") == 1.75
    assert harness.median_ratio([1.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == 2.0


def test_the_ratio_is_the_median_of_paired_ratios_not_the_ratio_of_medians():
    # repeat 2 ran on a busy machine: both sides slow, the pair still agrees
    base, other = [10.0, 30.0, 11.0], [5.0, 15.0, 10.0]
    assert harness.median_ratio(base, other) == 2.0
    assert harness.median(base) / harness.median(other) == 1.1


# -- printing ------------------------------------------------------------------------------
def test_markdown_table_pads_columns():
    text = harness.markdown_table(["a", "long header"], [[1, "x"], ["wide cell", 2.5]])
    assert text.splitlines() == [
        "| a         | long header |",
        "|-----------|-------------|",
        "| 1         | x           |",
        "| wide cell | 2.5         |",
    ]


def test_fmt_and_human_bytes():
    assert harness.fmt(1.23456, 3) == "1.235"
    assert harness.fmt(None) == "-" and harness.fmt(float("nan")) == "-"
    assert harness.human_bytes(None) == "-"
    assert harness.human_bytes(512) == "512 B"
    assert harness.human_bytes(1536) == "1.5 KiB"
    assert harness.human_bytes(179.8 * 2**20) == "179.8 MiB"


# -- provenance and JSON -------------------------------------------------------------------
def test_write_json_is_strict_json_with_unknowns_as_strings(tmp_path):
    path = harness.write_json(
        tmp_path / "deep" / "out.json",
        {"a": float("nan"), "b": [1, float("inf"), (2, 3)], 4: {"c": None}},
    )
    text = path.read_text(encoding="utf-8")
    assert text.endswith("}\n")
    assert json.loads(text) == {"a": "nan", "b": [1, "inf", [2, 3]], "4": {"c": None}}
    assert "NaN" not in text  # json.loads(strict) readers elsewhere choke on NaN


def test_environment_names_the_commit_and_the_checkout():
    import kvchat

    measured = Path(kvchat.__file__).resolve().parent
    env = harness.environment(3)
    assert env["threads"] == 3
    assert env["kvchat"] == str(measured)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=measured.parent, capture_output=True, text=True
    ).stdout.strip()
    assert env["git_commit"] == (commit or None)
    for key in ("date", "python", "torch", "transformers", "loadavg_at_start", "argv"):
        assert key in env


def test_environment_names_the_cpu_where_the_kernel_does():
    """Figures from a Xeon and from an EPYC are not comparable: a run names its CPU."""
    env = harness.environment(None)
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        assert env["cpu_model"] is None
        return
    names = [
        line.split(":", 1)[1].strip()
        for line in cpuinfo.read_text(errors="replace").splitlines()
        if line.startswith("model name")
    ]
    assert env["cpu_model"] == (names[0] if names and names[0] else None)


def test_save_run_writes_name_fields_environment_and_wall_time(tmp_path, capsys):
    env = {"git_commit": "abc1234"}
    path = harness.save_run(tmp_path / "r.json", "bench_x", {"results": {"a": 1.5}}, env, 2.0)
    assert json.loads(path.read_text()) == {
        "benchmark": "bench_x",
        "results": {"a": 1.5},
        "environment": env,
        "wall_seconds": 2.0,
    }
    assert capsys.readouterr().err == f"wrote {path}\n"


def test_the_harness_and_the_environment_import_no_torch():
    code = (
        "import sys; from kvchat.lab import harness; harness.environment(1); "
        "harness.median([1.0]); print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_kvchat_bench_results_carry_the_environment(tmp_path):
    from kvchat.lab.context import LabContext
    from kvchat.lab.report import Section
    from kvchat.lab.runner import run_suite

    ctx = LabContext(results_dir=tmp_path, say=lambda _m: None)
    _, paths = run_suite("bench", ctx, [("x", lambda c: Section(key="x", title="x"))], "k")
    env = json.loads(paths["json"].read_text())["meta"]["environment"]
    assert env["kvchat"] == harness.kvchat_location() and "git_commit" in env


# -- the benchmarks use the harness --------------------------------------------------------
# What the harness does; a benchmark that defines one of these has copied it.
HARNESS_JOBS = {
    "median",
    "spread",
    "rotated",
    "interleaved",
    "paired_ratios",
    "paired_step_ratio",
    "median_ratio",
    "ratio_of",
    "intervals",
    "diffs",
    "stopwatch",
    "seconds_per_op",
    "synchronizer",
    "drop_pages",
    "collect",
    "say",
    "fmt",
    "human_bytes",
    "human",
    "markdown_table",
    "environment",
    "git_commit",
    "kvchat_location",
    "jsonable",
    "write_json",
    "save_run",
}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _defined(tree: ast.Module) -> set[str]:
    """Every function and class name, private ones without their underscores."""
    return {
        node.name.lstrip("_")
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }


def _imports_harness(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.module == "kvchat.lab.harness":
                return True
            if node.module == "kvchat.lab" and any(a.name == "harness" for a in node.names):
                return True
        if isinstance(node, ast.Import) and any(a.name == "kvchat.lab.harness" for a in node.names):
            return True
    return False


def _imported_modules(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_there_are_benchmarks_to_check():
    assert len(SCRIPTS) >= 7, SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS + [BENCHMARKS / "common.py"], ids=lambda p: p.name)
def test_each_benchmark_imports_the_harness_and_copies_none_of_it(path):
    tree = _tree(path)
    assert _imports_harness(tree), f"{path.name} does not import kvchat.lab.harness"
    copied = _defined(tree) & HARNESS_JOBS
    assert not copied, f"{path.name} defines its own {sorted(copied)}: use kvchat.lab.harness"
    # statistics and hand-written JSON output go through the harness too
    assert "statistics" not in _imported_modules(tree), path.name


def test_no_benchmark_writes_json_by_hand():
    for path in SCRIPTS:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "write_text" and node.args:
                    arg = node.args[0]
                    hand_json = (
                        isinstance(arg, ast.Call)
                        and isinstance(arg.func, ast.Attribute)
                        and arg.func.attr == "dumps"
                    )
                    # the one exception: bench_peers hands its prompt ids to its children
                    assert not hand_json or path.name == "bench_peers.py", path.name


@pytest.mark.parametrize("path", sorted(REPO.glob("kvchat/lab/*.py")), ids=lambda p: p.name)
def test_lab_modules_define_no_harness_job_but_the_harness(path):
    if path.name == "harness.py":
        return
    copied = _defined(_tree(path)) & HARNESS_JOBS
    assert not copied, f"{path.name} defines its own {sorted(copied)}: use kvchat.lab.harness"


def test_a_peer_that_cannot_run_the_file_is_named_in_one_line(tmp_path):
    """The benchmarks ask llama.cpp to run a few tokens before timing it: a file it cannot
    load (or no llama.cpp at all) gives one line saying why, which they print as the reason
    the llama.cpp rows are skipped, instead of dying in the middle of a run."""
    not_a_model = tmp_path / "notes.gguf"
    not_a_model.write_text("not a GGUF")
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import common; "
        "print(common.llama_cpp_problem(sys.argv[2]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(BENCHMARKS), str(not_a_model)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    why = out.stdout.strip()
    assert "\n" not in why
    assert why.startswith(("llama.cpp did not run: ", "llama_cpp is not importable")), why
