"""Run the app under uvicorn; SIGTERM and Ctrl-C finish the save in progress, then exit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from kvchat.engine.chat.settings import CacheSettings
from kvchat.engine.models.loaded import LoadedModel
from kvchat.serve.app import create_app
from kvchat.serve.auth import check_bind
from kvchat.serve.worker import EngineWorker

GRACEFUL_SHUTDOWN_SECONDS = 30


class _Server(uvicorn.Server):
    """Stops the reply in progress at the first signal, so uvicorn's graceful shutdown
    (which waits for open responses) is not held up by a long generation."""

    def __init__(self, config: uvicorn.Config, worker: EngineWorker) -> None:
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.worker.begin_shutdown()
        super().handle_exit(sig, frame)


def serve(
    loaded: LoadedModel,
    *,
    cache: CacheSettings,
    data_dir: Path,
    host: str,
    port: int,
    api_key: str | None,
    say: Callable[[str], None],
) -> None:
    check_bind(host, api_key)
    worker = EngineWorker(loaded, cache=cache, data_dir=data_dir, say=say)
    app = create_app(worker, model_name=loaded.name, api_key=api_key)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    server = _Server(config, worker)
    shown = f"[{host}]" if ":" in host else host
    say(f"serving {loaded.name} on http://{shown}:{port}/v1 (Ctrl-C or SIGTERM to stop)")
    try:
        server.run()  # re-raises a caught SIGTERM once the app has shut down
    finally:
        worker.close()  # a no-op after the app's shutdown; covers a failed start
