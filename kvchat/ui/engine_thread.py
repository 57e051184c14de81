"""One long-lived thread that runs every engine call, in order.

Why not Textual's thread workers: they run in asyncio's default executor, whose threads are
joined when the app exits, so quitting during a 30 s model load or a long reply would leave
the terminal restored but the process hanging until the engine finished. This thread is a
daemon and exits with the process. Running every call on the same thread also means the
engine's session (which is not thread safe) is never touched by two threads at once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class EngineThread:
    def __init__(self, name: str = "kvchat-engine") -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._pending > 0

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` after the jobs already queued. It must catch its own errors."""
        with self._lock:
            self._pending += 1
        if not self._thread.is_alive():
            self._thread.start()
        self._jobs.put(job)

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the queued jobs (a shutdown's last ones)."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException:  # a job's own handler reports its errors
                pass
            finally:
                with self._lock:
                    self._pending -= 1
