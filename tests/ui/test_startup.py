"""The app module imports fast and without torch: the window must appear within a second."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys, time
t = time.perf_counter()
import kvchat.ui.app
elapsed = time.perf_counter() - t
heavy = [m for m in ("torch", "transformers", "kvchat.storage", "safetensors") if m in sys.modules]
print(json.dumps({"seconds": elapsed, "heavy": heavy}))
"""


def test_app_module_imports_fast_without_torch():
    runs = []
    for _ in range(2):  # the first run may pay for a cold disk cache
        out = subprocess.run(
            [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
        ).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["heavy"] == [] for r in runs), runs
    assert min(r["seconds"] for r in runs) < 1.0, runs
