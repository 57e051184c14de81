"""Bad input to every CLI command: one line saying what to do, never a traceback.

Most cases must be refused before any model is loaded (usage errors exit 2, in well under
the seconds a model load takes); the few that need the model to know the input is bad are
marked slow. The cases run in this process (``kvchat_here``: click's runner, the exit
status and output a user gets), since none needs a signal or a second process.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.test_cli import kvchat_here

BAD_UTF8 = b"caf\xe9 au lait\n"  # latin-1, not UTF-8


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad")
    latin1 = root / "latin1.txt"
    latin1.write_bytes(BAD_UTF8)
    blank = root / "blank.txt"
    blank.write_text("  \n\t\n")
    a_file = root / "a-file"
    a_file.write_text("not a directory")
    return {"latin1": str(latin1), "blank": str(blank), "file": str(a_file), "dir": str(root)}


# (arguments, expected exit status). "{latin1}" etc. are filled from ``bad_files``.
BAD_INPUTS = [
    (["run", "--prompt-file", "{latin1}"], 2),
    (["run", "--prompt-file", "{blank}"], 2),
    (["run", "--prompt-file", "{dir}"], 2),
    (["run", "--temperature", "nan", "--prompt", "hi"], 2),
    (["run", "--temperature", "inf", "--prompt", "hi"], 2),
    (["run", "--temperature", "-1", "--prompt", "hi"], 2),
    (["run", "--top-p", "0", "--prompt", "hi"], 2),
    (["run", "--top-p", "1.5", "--prompt", "hi"], 2),
    (["run", "--top-p", "nan", "--prompt", "hi"], 2),
    (["run", "--prompt", ""], 2),
    (["run", "--prompt", "   \n "], 2),
    (["run"], 2),
    (["run", "--max-mem", "0", "--prompt", "hi"], 2),
    (["run", "--max-mem", "10B", "--prompt", "hi"], 2),
    (["run", "--max-mem", "1e999GB", "--prompt", "hi"], 2),
    (["run", "--max-mem", "100000000000TB", "--prompt", "hi"], 2),
    (["run", "--seed", "99999999999999999999999", "--prompt", "hi"], 2),
    (["run", "--kv-dtype", "float16", "--prompt", "hi"], 2),
    (["run", "--conversation", "no-such-id", "--prompt", "hi"], 1),
    (["run", "--conversation", "x", "--data-dir", "{file}", "--prompt", "hi"], 1),
    (["resume", "no-such-id"], 1),  # the app path: fails before loading the model
    (["resume", "no-such-id", "--prompt", "hi"], 1),
    (["resume", "x", "--data-dir", "{file}"], 1),
    (["resume", "x", "--max-mem", "0"], 2),
    (["export", "no-such-id"], 1),
    (["export", "x", "--format", "xml"], 2),
    (["export", "x", "--data-dir", "{file}"], 1),
    (["delete", "no-such-id"], 1),
    (["delete", "x", "--data-dir", "{file}"], 1),
    (["list", "--bogus"], 2),
    (["inspect", "no-such-model"], 1),
    (["inspect", "smollm2-135m", "--dtype", "int3"], 2),
    (["inspect", "smollm2-135m", "--tokens", "0"], 2),
    (["models", "--bogus"], 2),
    (["verify", "--only", "nope"], 2),
    (["bench", "--device", "tpu"], 2),
    (["chat", "--max-mem", "0"], 2),
    (["chat", "--dtype", "int3"], 2),
    (["--max-mem", "-5MB"], 2),
    (["--data-dir"], 2),
    (["list", "--data-dir", "{file}"], 1),
]


@pytest.mark.parametrize(
    "args, status", BAD_INPUTS, ids=lambda v: " ".join(v) if isinstance(v, list) else str(v)
)
def test_bad_input_gets_one_line_and_no_traceback(bad_files, args, status, tmp_path):
    args = [a.format(**bad_files) for a in args]
    started = time.monotonic()
    out = kvchat_here(*args, env=_env(tmp_path))
    both = out.stdout + out.stderr
    assert "Traceback" not in both, both
    assert out.returncode == status, both
    assert time.monotonic() - started < 20, "refused only after loading something"
    assert "kvchat: loading" not in out.stderr  # refused before any model was loaded
    errors = [line for line in out.stderr.splitlines() if "rror" in line]
    assert len(errors) == 1, out.stderr


def _env(tmp_path: Path) -> dict[str, str]:
    import os

    return {**os.environ, "KVCHAT_DATA_DIR": str(tmp_path / "data")}


@pytest.mark.parametrize("command", [[], ["chat"], ["run"], ["resume", "x"]])
def test_every_model_command_takes_a_data_dir(command):
    out = kvchat_here(*command, "--help")
    assert out.returncode == 0 and "--data-dir" in out.stdout


def test_sizes_print_in_sensible_units():
    from kvchat.units import human_bytes

    assert human_bytes(3 * 2**40) == "3.0 TiB"
    assert human_bytes(2**50) == "1.0 PiB"
    assert human_bytes(10**20) == "88,818 PiB"
    assert human_bytes(513.1 * 2**20) == "513.1 MiB"


@pytest.mark.slow
def test_a_prompt_past_the_context_length_is_refused_with_the_numbers(tmp_path):
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text("the sea and the ship " * 2100)  # ~10K tokens, SmolLM2 has 8192
    started = time.monotonic()
    out = kvchat_here("run", "--no-save", "--prompt-file", str(long_prompt), env=_env(tmp_path))
    assert out.returncode == 1, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("kvchat: error:") and "8,192" in line and "tokens" in line
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert time.monotonic() - started < 60  # no prefill of 10K tokens on this CPU


@pytest.mark.slow
def test_a_turn_that_cannot_be_saved_exits_3_and_says_so(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("a regular file, so no data dir can be created under it")
    out = kvchat_here(
        "run", "--data-dir", str(a_file / "data"), "--max-new-tokens", "4",
        "--prompt", "Hi", "--prompt", "Bye", env=_env(tmp_path),
    )  # fmt: skip
    assert out.returncode == 3, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.count("saving failed") == 2
    assert "turns 1-2 are not saved" in out.stderr
    js = kvchat_here(
        "run", "--json", "--data-dir", str(a_file / "data"), "--max-new-tokens", "4",
        "--prompt", "Hi", env=_env(tmp_path),
    )  # fmt: skip
    assert js.returncode == 3
    turn = json.loads(js.stdout)
    assert turn["saved"] is False and turn["error"]


@pytest.mark.slow
def test_a_base_model_gets_plain_completion_and_is_told_so(smollm2_dir, tmp_path):
    """SmolLM2 without its chat template stands in for a base model (as Gemma 3 270M is)."""
    base = tmp_path / "base-model"
    base.mkdir()
    for f in smollm2_dir.iterdir():
        if f.name == "chat_template.jinja":
            continue
        if f.name == "tokenizer_config.json":
            config = json.loads(f.read_text())
            config.pop("chat_template", None)
            (base / f.name).write_text(json.dumps(config))
        else:
            (base / f.name).symlink_to(f)
    from kvchat.engine.models.quantized_load import small_form_path

    try:
        out = kvchat_here(
            "run", "--model", str(base), "--no-save", "--max-new-tokens", "12",
            "--prompt", "The capital of France is", env=_env(tmp_path),
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "is a base model (no chat template): plain completion" in out.stderr
        assert "Assistant" not in out.stdout and "User" not in out.stdout
        js = kvchat_here(
            "run", "--model", str(base), "--no-save", "--max-new-tokens", "4", "--json",
            "--prompt", "The capital of France is", env=_env(tmp_path),
        )  # fmt: skip
        assert json.loads(js.stdout)["prompt_tokens"] == 5  # the prompt alone, no wrapper
    finally:  # the int4 form of this tmp directory, written into the user's cache
        shutil.rmtree(small_form_path(base, "int4").parent, ignore_errors=True)


@pytest.mark.slow
def test_kv_wider_than_the_model_computes_is_refused_with_the_fix(tmp_path):
    out = kvchat_here(
        "run", "--no-save", "--dtype", "bfloat16", "--kv-dtype", "float32", "--prompt", "hi",
        env=_env(tmp_path),
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("kvchat: error:") and "use --kv-dtype auto" in line
    assert "Traceback" not in out.stderr and out.stdout == ""
