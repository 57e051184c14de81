"""Storage knows files, not models: importing it must not import torch or transformers."""

from __future__ import annotations

import subprocess
import sys


def test_storage_imports_neither_torch_nor_transformers():
    code = (
        "import sys\n"
        "import kvchat.storage, kvchat.storage.segments, kvchat.storage.store\n"
        "import kvchat.storage.spill, kvchat.storage.text, kvchat.storage.safe_fs\n"
        "heavy = [m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
