"""--api-key: Bearer token required; other addresses refused without one."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import openai
import pytest

from tests.serve.server_process import ServerProcess

KEY = "test-key-0123456789"


def test_binding_beyond_loopback_without_a_key_fails_at_once(tmp_path):
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "kvchat.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_environ_without_key(), "KVCHAT_DATA_DIR": str(tmp_path)},
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--api-key" in lines[0]
    assert time.perf_counter() - started < 10  # refused before loading the model


def _environ_without_key() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "KVCHAT_API_KEY"}


@pytest.mark.slow
def test_the_key_is_required_and_checked(tmp_path):
    server = ServerProcess(tmp_path / "data", api_key=KEY).start()
    try:
        reply = server.client().chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert reply.choices[0].message.content is not None
        wrong = server.client()
        wrong.api_key = "not-the-key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        status, headers, _ = server.request(
            "POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}'
        )
        assert status == 401 and headers.get("www-authenticate") == "Bearer"
        assert server.request("GET", "/health")[0] == 200  # liveness needs no key
    finally:
        server.stop()
