"""Run the app on the fake engine: ``python -m tests.ui.fake_app [--delay S]``.

For looking at the layout in a real terminal without loading a model (and for the snapshot
tests, which import :func:`make_app`).
"""

from __future__ import annotations

import sys

from kvchat.ui.app import KvchatApp
from tests.ui.fakes import SAMPLE_CONVERSATIONS, SAMPLE_SAVED, FakeBackend


def make_app(**kwargs) -> KvchatApp:
    return KvchatApp(FakeBackend(**kwargs))


if __name__ == "__main__":
    delay = float(sys.argv[sys.argv.index("--delay") + 1]) if "--delay" in sys.argv else 0.05
    make_app(
        delay=delay, load_delay=1.0, conversations=SAMPLE_CONVERSATIONS, saved=SAMPLE_SAVED
    ).run()
