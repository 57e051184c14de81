"""A long prompt shows its prefill progress on stderr (kvchat run)."""

from __future__ import annotations

import pytest

from tests.test_cli import kvchat_here

pytestmark = pytest.mark.slow


def test_a_long_prompt_shows_prefill_progress(tmp_path, smollm2_dir):
    prompt = tmp_path / "long.txt"
    prompt.write_text(
        " ".join(f"Item {i} is a blue box." for i in range(220)) + " Which item is 7?"
    )
    out = kvchat_here(
        "run", "--model", str(smollm2_dir), "--no-save", "--max-new-tokens", "4",
        "--prompt-file", str(prompt),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stderr.splitlines() if "reading the prompt" in x]
    assert len(lines) >= 2 and lines[-1].endswith("(100%)"), out.stderr
    assert out.stdout.strip()  # the reply still reaches stdout, untouched
