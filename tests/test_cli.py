"""The headless CLI contract: `kvchat run`, `models`, `inspect`, errors, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest


def kvchat(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvchat.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def kvchat_here(
    *args: str, env: dict[str, str | None] | None = None
) -> subprocess.CompletedProcess:
    """``kvchat ARGS`` in this process (click's ``CliRunner``): the exit status, stdout and
    stderr a user gets, without a new interpreter importing torch again. For commands that
    need no signal and no second process. An exception the CLI let through is put on stderr
    as its traceback, as a real process would print it. The thread counts a model load
    sets for the whole process are given back after, so later tests run as before. ``env``:
    variables set for the call only (None: unset)."""
    import traceback

    import torch
    from click.testing import CliRunner

    from kvchat import threads
    from kvchat.cli import cli

    torch_threads, counts = torch.get_num_threads(), threads.counts()
    try:
        result = CliRunner().invoke(cli, list(args), prog_name="kvchat", env=env)
    finally:
        if "threads" in counts:
            threads.apply_threads(counts["threads"])
        threads.set_decode_threads(counts.get("decode_threads"))
        torch.set_num_threads(torch_threads)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, stderr)


def test_help_is_instant_and_imports_no_torch():
    start = time.perf_counter()
    out = kvchat("--help")
    assert out.returncode == 0 and "run" in out.stdout
    assert time.perf_counter() - start < 3  # the interpreter itself takes most of it
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, kvchat.cli; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "False"


@pytest.mark.slow
def test_inspect_prints_the_per_layer_table():
    out = kvchat_here("inspect", "smollm2-135m")
    assert out.returncode == 0
    assert "23,040" in out.stdout or "22.5 KiB" in out.stdout
    data = json.loads(kvchat_here("inspect", "gemma-3-4b", "--json").stdout)
    assert len(data["layers"]) == 34


def test_models_lists_aliases():
    out = kvchat("models")
    assert out.returncode == 0
    for alias in ("gemma-3-4b", "smollm2-135m", "phi-3-mini", "qwen2.5-0.5b"):
        assert alias in out.stdout


@pytest.mark.slow
def test_unknown_model_is_one_clear_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    out = kvchat("run", "--model", "nobody/no-such-model", "--prompt", "hi", env=env)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvchat: error:")
    assert "Traceback" not in out.stderr


def test_bad_size_is_rejected():
    out = kvchat("run", "--max-mem", "lots", "--prompt", "hi")
    assert out.returncode == 2 and "64MB" in out.stderr


@pytest.mark.slow
def test_run_json_contract_two_turns(smollm2_dir):
    out = kvchat_here(
        "run", "--model", str(smollm2_dir), "--json", "--max-new-tokens", "20",
        "--prompt", "What is the capital of France?", "--prompt", "And of Italy?",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    turns = [json.loads(line) for line in out.stdout.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2]
    assert "Paris" in turns[0]["reply"] and "Rome" in turns[1]["reply"]
    for t in turns:
        assert t["tokens"] and all(isinstance(i, int) for i in t["tokens"])
        assert {"state_bytes", "standard_equivalent_bytes", "hot_tokens"} <= set(t["memory"])


@pytest.mark.slow
def test_memory_line_and_standard_cache_give_the_same_tokens(smollm2_dir):
    common = ["run", "--model", str(smollm2_dir), "--max-new-tokens", "30",
              "--prompt", "Tell me about the sea.", "--prompt", "And rivers?"]  # fmt: skip
    ours = kvchat_here(*common, "--max-mem", "2MB", "--prefill-chunk", "16")
    assert ours.returncode == 0, ours.stderr
    mem_lines = [line for line in ours.stderr.splitlines() if line.startswith("[mem]")]
    assert len(mem_lines) == 2
    assert "/ 1.9 MiB ceiling" in mem_lines[0] and "checkpointed" in mem_lines[0]
    standard = kvchat_here(*common, "--cache", "standard")
    assert standard.returncode == 0
    assert ours.stdout == standard.stdout
    js = kvchat_here(*common, "--max-mem", "2MB", "--prefill-chunk", "16", "--json")
    memory = json.loads(js.stdout.splitlines()[-1])["memory"]
    assert memory["checkpointed_tokens"] > 0 and memory["state_bytes"] <= 2_000_000
    assert memory["disk_tier"] and memory["forms"] == "kv" and memory["plan"].startswith("disk")


@pytest.mark.slow
def test_kv_dtype_bfloat16_from_the_command_line(smollm2_dir):
    """``--kv-dtype bfloat16``: the same reply under a ceiling as the standard cache holding
    bfloat16, and the memory record says what the K/V are held in."""
    common = ["run", "--model", str(smollm2_dir), "--max-new-tokens", "30", "--no-save",
              "--kv-dtype", "bfloat16", "--prompt", "Tell me about the sea."]  # fmt: skip
    ours = kvchat_here(*common, "--max-mem", "1MB", "--json")
    assert ours.returncode == 0, ours.stderr
    standard = kvchat_here(*common, "--cache", "standard", "--json")
    assert standard.returncode == 0, standard.stderr
    ours_turn, standard_turn = json.loads(ours.stdout), json.loads(standard.stdout)
    assert ours_turn["tokens"] == standard_turn["tokens"]
    assert ours_turn["memory"]["kv_dtype"] == "bfloat16"
    assert ours_turn["memory"]["checkpointed_tokens"] > 0


@pytest.mark.slow
def test_ceiling_too_small_is_one_clear_line(smollm2_dir, tmp_path):
    # 64 KiB is the smallest ceiling accepted; ~4,500 tokens' ids alone pass half of it.
    prompt = tmp_path / "long.txt"
    prompt.write_text(" ".join(f"note {i} is on shelf {i % 13}." for i in range(600)))
    out = kvchat_here(
        "run", "--model", str(smollm2_dir), "--max-mem", "64KiB", "--prompt-file", str(prompt)
    )
    assert out.returncode == 1
    assert "--max-mem" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_ctrl_c_ends_the_reply_cleanly(smollm2_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat.cli", "run", "--model", str(smollm2_dir),
         "--max-new-tokens", "400", "--prompt", "Write a very long story about a ship."],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    got = ""
    deadline = time.time() + 120
    while len(got.split()) < 5 and time.time() < deadline:
        got += proc.stdout.read(1)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert (got + rest).rstrip().endswith("[stopped]")
    assert "Traceback" not in err and "[mem]" in err


@pytest.mark.slow
def test_saved_conversation_resumes_list_export_delete(smollm2_dir, tmp_path):
    data = ["--data-dir", str(tmp_path)]
    model = ["--model", str(smollm2_dir), "--max-new-tokens", "16", "--hot-window", "6"]
    prompts = ["--prompt", "What is the capital of France?", "--prompt", "And of Spain?"]
    both = kvchat_here("run", *model, "--json", "--no-save", *prompts)
    expected = [json.loads(line)["tokens"] for line in both.stdout.splitlines()]

    first = kvchat_here(
        "run", *model, *data, "--json", "--prompt", "What is the capital of France?"
    )
    turn1 = json.loads(first.stdout)
    conv_id = turn1["conversation"]
    assert conv_id and turn1["tokens"] == expected[0]
    second = kvchat_here("resume", conv_id, *model, *data, "--json", "--prompt", "And of Spain?")
    assert second.returncode == 0, second.stderr
    turn2 = json.loads(second.stdout)
    assert turn2["tokens"] == expected[1] and turn2["conversation"] == conv_id
    assert turn2["memory"]["disk_bytes"] > 0

    listing = kvchat_here("list", *data)
    assert conv_id in listing.stdout and "What is the capital of France?" in listing.stdout
    md = kvchat_here("export", conv_id[:12], "--format", "md", *data)
    assert "And of Spain?" in md.stdout and "Madrid" in md.stdout
    exported = json.loads(kvchat_here("export", conv_id, "--format", "json", *data).stdout)
    assert len(exported["messages"]) == 4
    assert kvchat_here("delete", conv_id, *data).returncode == 0
    assert conv_id not in kvchat_here("list", *data).stdout
    gone = kvchat_here("run", *model, *data, "--conversation", conv_id, "--prompt", "Hi")
    assert gone.returncode == 1 and len(gone.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_regenerate_answers_the_last_prompt_again_as_a_fork_or_in_place(smollm2_dir, tmp_path):
    data = ["--data-dir", str(tmp_path)]
    model = ["--model", str(smollm2_dir), "--max-new-tokens", "16", "--json"]
    sampled = ["--temperature", "0.7", "--seed", "5"]
    asked = ["--prompt", "What is the capital of France?", "--prompt", "And of Spain?"]
    first = kvchat_here("run", *model, *data, *asked)
    assert first.returncode == 0, first.stderr
    original = [json.loads(line) for line in first.stdout.splitlines()]
    conv_id = original[0]["conversation"]
    # A fresh process fed the same history: turn 1 greedy, turn 2 sampled with the seed.
    one = kvchat_here("run", *model, *data, "--prompt", "What is the capital of France?")
    other = json.loads(one.stdout)["conversation"]
    expected = kvchat_here("run", *model, *data, *sampled, "--conversation", other, *asked[2:])
    expected_tokens = json.loads(expected.stdout)["tokens"]

    again = kvchat_here("run", *model, *data, *sampled, "--conversation", conv_id, "--regenerate")
    assert again.returncode == 0, again.stderr
    turn = json.loads(again.stdout)
    assert turn["prompt"] == "And of Spain?" and turn["tokens"] == expected_tokens
    fork = turn["conversation"]
    assert fork != conv_id
    listed = {
        r["id"]: r for r in json.loads(kvchat_here("list", "--json", *data).stdout)["conversations"]
    }
    assert listed[fork]["forked_from"] == {"id": conv_id, "turn": 1}
    kept = json.loads(kvchat_here("export", conv_id, "--format", "json", *data).stdout)
    assert kept["messages"][3]["content"] == original[1]["reply"]  # the original keeps its reply

    in_place = kvchat_here(
        "run", *model, *data, *sampled, "--conversation", conv_id, "--regenerate", "--in-place"
    )
    assert in_place.returncode == 0, in_place.stderr
    assert json.loads(in_place.stdout)["conversation"] == conv_id
    assert json.loads(in_place.stdout)["tokens"] == expected_tokens
    replaced = json.loads(kvchat_here("export", conv_id, "--format", "json", *data).stdout)
    assert len(replaced["messages"]) == 4
    assert replaced["messages"][3]["content"] == turn["reply"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--in-place", "--prompt", "x"], "--in-place only goes with --regenerate"),
        (["--regenerate"], "--regenerate needs --conversation"),
        (["--regenerate", "--conversation", "x", "--no-save"], "drop --no-save"),
    ],
)
def test_regenerate_usage_errors_are_one_line_before_any_load(args, message, tmp_path):
    out = kvchat("run", "--data-dir", str(tmp_path), *args, timeout=60)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def test_regenerating_a_conversation_with_no_reply_says_so(tmp_path):
    from kvchat.storage import ConversationStore

    conv = ConversationStore(tmp_path).create(
        model_name="smollm2-135m", fingerprint="sha256:" + "ab" * 32, dtype="float32", settings={}
    )
    conv.close()
    out = kvchat("run", "--data-dir", str(tmp_path), "--conversation", conv.id, "--regenerate")
    assert out.returncode == 1 and "no reply to regenerate yet" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
