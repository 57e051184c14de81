"""Options the server's engine worker checks at startup, not at the first request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvchat.engine.chat.settings import CacheSettings
from kvchat.errors import KvchatError
from kvchat.serve.worker import EngineWorker


def test_a_kv_dtype_the_model_cannot_take_is_refused_at_startup(tmp_path):
    # Checked before anything else of the model is read: a bf16 model cannot hold float32 K/V.
    bf16_model = SimpleNamespace(dtype="bfloat16")
    with pytest.raises(KvchatError, match="use --kv-dtype auto"):
        EngineWorker(bf16_model, cache=CacheSettings(kv_dtype="float32"), data_dir=tmp_path)
