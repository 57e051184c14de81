"""Loading a model does not import scipy through transformers
(``kvchat.engine.models.lean_imports``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

needs_scipy = pytest.mark.skipif(
    importlib.util.find_spec("scipy") is None, reason="scipy is not installed: nothing to leave out"
)


def imports_scipy(code: str, **env: str) -> bool:
    check = code + "\nimport sys\nprint('scipy' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True, timeout=300,
        env={**__import__("os").environ, **env},
    )  # fmt: skip
    return out.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.slow
@needs_scipy
def test_the_modeling_code_imports_scipy_unless_told_not_to():
    modeling = "import transformers.models.llama.modeling_llama"
    assert imports_scipy(modeling)  # what transformers does by itself
    lean = "from kvchat.engine.models.lean_imports import leave_out_scipy\nleave_out_scipy()\n"
    assert not imports_scipy(lean + modeling)
    assert imports_scipy(lean + modeling, KVCHAT_SCIPY="1")


@needs_scipy
@pytest.mark.slow
def test_loading_the_default_model_leaves_scipy_out(smollm2_dir):
    load = f"from kvchat.engine.models.load import load\nload({str(smollm2_dir)!r}, weights='int4')"
    assert not imports_scipy(load)
