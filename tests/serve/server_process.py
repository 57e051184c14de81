"""A real `kvchat serve` subprocess on 127.0.0.1 and a free port, for the tests."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

START_TIMEOUT_S = 180  # loading the model; a busy 2-core machine is slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, data_dir: Path, *extra: str, api_key: str | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.extra = extra
        self.api_key = api_key
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir.parent / f"serve-{self.port}.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> ServerProcess:
        args = [sys.executable, "-m", "kvchat.cli", "serve", "--port", str(self.port)]
        args += ["--data-dir", str(self.data_dir), *self.extra]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        env.pop("KVCHAT_API_KEY", None)
        if self.api_key:
            env["KVCHAT_API_KEY"] = self.api_key
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvchat serve exited early:\n{self.read_log()}")
            try:
                if self.request("GET", "/health", timeout=1)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"kvchat serve did not start:\n{self.read_log()}")

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 120,
    ) -> tuple[int, dict[str, str], bytes]:
        """A raw HTTP request (for what the official client would not send)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=self.api_key or "unused", **kw)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then wait: the exit status (0 or -SIGTERM once it has shut down)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if getattr(self, "log", None) is not None:
            self.log.close()

    def read_log(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def rss_bytes(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss
