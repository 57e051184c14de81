"""Where kvchat keeps files: model cache and conversation store (XDG by default)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Converted models and downloaded wheels. Override with KVCHAT_CACHE_DIR."""
    override = os.environ.get("KVCHAT_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("kvchat"))


def data_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Saved conversations. ``--data-dir`` beats KVCHAT_DATA_DIR beats the XDG data dir."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get("KVCHAT_DATA_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("kvchat"))
