"""What resolving and loading a model show the user: progress lines and one-line errors,
with transformers' own reports and bars silenced (they would tear the TUI)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

Progress = Callable[[str], None]


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' load reports and tqdm bars: they would tear the TUI."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
