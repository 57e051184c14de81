"""Keep transformers from importing scipy, which no chat model here uses.

Why: importing any modeling code imports ``transformers.loss``, whose object-detection
losses import ``scipy.optimize`` whenever scipy is installed (for a Hungarian matcher): on
this machine 37 MiB of RSS and ~0.2 s of start-up for nothing a causal LM calls
(``python benchmarks/bench_rss.py`` lists what the modeling code imported). So before the
first modeling import, transformers' ``is_scipy_available`` answers False, unless scipy is
already imported (something in this process wants it) or ``KVCHAT_SCIPY=1``.

This module imports transformers only inside :func:`leave_out_scipy`.
"""

from __future__ import annotations

import os
import sys

__all__ = ["leave_out_scipy"]


def _never() -> bool:
    return False


def leave_out_scipy() -> bool:
    """Make transformers' modules imported from now on see no scipy; whether it did."""
    if "scipy" in sys.modules or os.environ.get("KVCHAT_SCIPY") == "1":
        return False
    if "transformers.loss.loss_for_object_detection" in sys.modules:
        return False  # too late: the losses are imported
    import transformers.utils as transformer_utils
    import transformers.utils.import_utils as import_utils

    transformer_utils.is_scipy_available = _never
    import_utils.is_scipy_available = _never
    return True
